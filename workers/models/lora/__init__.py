"""LoRA adapters on a base model: PEFT folders read and checked (`peft_folder`), the per-step
segments of rows sharing an adapter and the hook each projection carries (`projection`), and
the bounded device slots with LRU eviction (`slots`: the driver's `SlotTable`, the model's
`AdapterSlots`)."""

from __future__ import annotations

from workers.models.lora.peft_folder import LoraAdapterError
from workers.models.lora.projection import LoraBatch, LoraProjection, lora_active
from workers.models.lora.slots import AdapterSlots, SlotTable, SlotWrite

__all__ = ["AdapterSlots", "LoraAdapterError", "LoraBatch", "LoraProjection", "SlotTable",
           "SlotWrite", "lora_active"]
