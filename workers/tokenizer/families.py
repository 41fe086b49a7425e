"""The tokenizer families `workers.tokenizer.build` imitates: each one's special tokens (where
they sit among the ids, which are bos, eos, pad and unk, which also stop generation), its chat
template and its context length, modelled on the real families' `tokenizer_config.json`.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.tokenizer.reasoning_templates import DEEPSEEK_R1_TEMPLATE, HARMONY_TEMPLATE

# Chat templates modelled on the real families' `tokenizer_config.json` (Meta-Llama-3-8B-Instruct,
# Mistral-7B-Instruct-v0.2, Qwen2.5-Instruct); the Jinja string literals keep their `\n` escapes.
# Llama 3.1's JSON tool calling: the tools ahead of the first user message, a call written as
# {"name": ..., "parameters": ...}, a tool's answer in an "ipython" turn.
_LLAMA3_TEMPLATE = r"""{%- set ns = namespace(tools='', text='') %}
{%- if tools %}
    {%- set ns.tools = 'Given the following functions, please respond with a JSON for a function '
                       'call with its proper arguments that best answers the given prompt.\n\n'
                       'Respond in the format {"name": function name, "parameters": dictionary '
                       'of argument name and its value}. Do not use variables.\n\n' %}
    {%- for tool in tools %}
        {%- set ns.tools = ns.tools + (tool | tojson) + '\n\n' %}
    {%- endfor %}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
    {%- if message['tool_calls'] %}
        {%- set ns.text = '' %}
        {%- for call in message['tool_calls'] %}
            {%- set ns.text = ns.text + '{"name": "' + call['function']['name']
                              + '", "parameters": ' + (call['function']['arguments'] | tojson)
                              + '}' %}
        {%- endfor %}
    {%- else %}
        {%- set ns.text = message['content'] | trim %}
    {%- endif %}
    {%- if role == 'user' and ns.tools %}
        {%- set ns.text = ns.tools + ns.text %}
        {%- set ns.tools = '' %}
    {%- endif %}
    {%- set content = '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + ns.text
                      + '<|eot_id|>' %}
    {%- if loop.index0 == 0 %}
        {%- set content = bos_token + content %}
    {%- endif %}
    {{- content }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Mistral v0.3's tool calling: [AVAILABLE_TOOLS] before the last user message, calls after
# [TOOL_CALLS], results in [TOOL_RESULTS]; roles alternate only in a conversation without tools.
_MISTRAL_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(last_user=-1, tooling=(tools is not none and tools | length > 0)) %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
    {%- if message['role'] == 'tool' or message['tool_calls'] %}
        {%- set ns.tooling = true %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if not ns.tooling and (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must '
                            'alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if tools and loop.index0 == ns.last_user %}
            {{- ' [AVAILABLE_TOOLS] ' + (tools | tojson) + ' [/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- ' [TOOL_CALLS] [' }}
        {%- for call in message['tool_calls'] %}
            {{- '{"name": "' + call['function']['name'] + '", "arguments": '
                + (call['function']['arguments'] | tojson) + '}' }}
            {%- if not loop.last %}
                {{- ', ' }}
            {%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- elif message['role'] == 'tool' %}
        {{- ' [TOOL_RESULTS] {"content": ' + (message['content'] | tojson)
            + '} [/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, assistant and tool roles are supported, with the '
                            'exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Gemma 3's turns: a system message becomes the first user turn's prefix; the assistant is "model"
_GEMMA_TEMPLATE = r"""{{- bos_token }}
{%- if messages and messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- (message['content'] or '') | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""

_QWEN2_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

@dataclass(frozen=True)
class Family:
    """The special tokens, chat template and context length of one family's tokenizer."""

    leading_specials: tuple[str, ...]  # ids 0.. before the learned vocab (SentencePiece style)
    trailing_specials: tuple[str, ...]  # ids after the learned vocab (tiktoken style)
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    extra_stops: tuple[str, ...]
    chat_template: str
    model_max_length: int


FAMILIES: dict[str, Family] = {
    "llama": Family(
        leading_specials=(),
        trailing_specials=(
            "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
            "<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|reserved_special_token_2|>", "<|eot_id|>",
        ),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
        extra_stops=("<|end_of_text|>",),
        chat_template=_LLAMA3_TEMPLATE, model_max_length=131072,
    ),
    "mistral": Family(
        leading_specials=("<unk>", "<s>", "</s>"), trailing_specials=(),
        bos="<s>", eos="</s>", pad=None, unk="<unk>", extra_stops=(),
        chat_template=_MISTRAL_TEMPLATE, model_max_length=32768,
    ),
    "qwen2": Family(
        leading_specials=(), trailing_specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        extra_stops=("<|endoftext|>",),
        chat_template=_QWEN2_TEMPLATE, model_max_length=32768,
    ),
    "gemma": Family(
        leading_specials=("<pad>", "<eos>", "<bos>", "<unk>"),
        trailing_specials=("<start_of_turn>", "<end_of_turn>"),
        bos="<bos>", eos="<end_of_turn>", pad="<pad>", unk="<unk>", extra_stops=("<eos>",),
        chat_template=_GEMMA_TEMPLATE, model_max_length=32768,
    ),
    # DeepSeek-R1's tokens (its fullwidth bars and "▁" as written); <think> is plain text
    "deepseek": Family(
        leading_specials=(), trailing_specials=(
            "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
        unk=None, extra_stops=(), chat_template=DEEPSEEK_R1_TEMPLATE, model_max_length=131072,
    ),
    # gpt-oss's o200k_harmony specials; a turn ends at <|return|> (an answer) or <|call|>
    "harmony": Family(
        leading_specials=(), trailing_specials=(
            "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
            "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
        bos=None, eos="<|return|>", pad="<|endoftext|>", unk=None,
        extra_stops=("<|call|>", "<|endoftext|>"),
        chat_template=HARMONY_TEMPLATE, model_max_length=131072,
    ),
}

SUPPORTED_ARCHS = tuple(sorted(FAMILIES))
