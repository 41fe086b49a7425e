"""gpt-oss's Harmony markup, as the text keeps it (its markers are special tokens): what the
reasoning parser (`reasoning.HarmonyChannels`) and the tool-call parser
(`tool_parsers.HarmonyCalls`) both read.

A message is `<|start|>ROLE<|channel|>CHANNEL ...<|message|>BODY` ended by `<|end|>`,
`<|return|>` (the last answer) or `<|call|>` (a tool call). A function call names its
recipient, `to=functions.NAME`, in the role (`<|start|>assistant to=functions.NAME<|channel|>
commentary json<|message|>`, as gpt-oss's template renders earlier calls) or in the channel
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`, as the model
mostly writes them); its body is the arguments' JSON text.
"""

from __future__ import annotations

import re

MARKERS = tuple(f"<|{m}|>" for m in
                ("start", "channel", "message", "end", "return", "call", "constrain"))
MARKER = re.compile(r"<\|(start|channel|message|end|return|call|constrain)\|>")
CALL_END = "<|call|>"
# a whole message header: role, then channel words (the constraint among them), then <|message|>
HEADER = re.compile(r"<\|start\|>([^<]*)<\|channel\|>([^<]*)(?:<\|constrain\|>([^<]*))?"
                    r"<\|message\|>")
_RECIPIENT = re.compile(r"(?:^|\s)to=functions\.([A-Za-z0-9_.\-]+)")


def function_called(header: str) -> str | None:
    """The function a message header (its role and channel words) is addressed to; None: the
    message is no function call."""
    found = _RECIPIENT.search(header)
    return found.group(1) if found else None


def call_opening(name: str) -> str:
    """The header of a call to function `name`, in the form the model writes."""
    return (f"<|start|>assistant<|channel|>commentary to=functions.{name} "
            "<|constrain|>json<|message|>")

