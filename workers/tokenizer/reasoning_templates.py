"""The chat templates of the reasoning families `make-model` writes, modelled on the real ones
(their `tokenizer_config.json` / `chat_template.jinja`); the Jinja string literals keep their
`\n` escapes. Both drop an earlier assistant turn's reasoning, as the real ones do.

- DeepSeek-R1 (`deepseek`, for deepseek_v3 checkpoints): `<｜User｜>` / `<｜Assistant｜>` turns
  after the system text, and a generation prompt that opens the thinking block
  (`<｜Assistant｜><think>\n`), so the output starts inside it (`--reasoning-parser deepseek_r1`).
- gpt-oss's Harmony (`harmony`, for gpt_oss checkpoints): `<|start|>role<|message|>...<|end|>`
  messages, a system message naming the valid channels, the request's system text as the
  developer's instructions, earlier answers on the `final` channel, and a generation prompt of
  `<|start|>assistant`, so the output opens with its channel (`--reasoning-parser gpt_oss`).
  Tools are not rendered yet (a request with tools is refused as for any template without
  them).
"""

from __future__ import annotations

DEEPSEEK_R1_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
        {{- message['content'] }}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '<｜User｜>' + message['content'] }}
    {%- elif message['role'] == 'assistant' %}
        {%- set content = message['content'] or '' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜><think>\n' }}
{%- endif %}
"""

HARMONY_TEMPLATE = r"""{{- '<|start|>system<|message|>You are ChatGPT, a large language model '
    'trained by OpenAI.\nReasoning: ' + (reasoning_effort | default('medium')) + '\n\n'
    '# Valid channels: analysis, commentary, final. Channel must be included for every '
    'message.<|end|>' }}
{%- if messages and messages[0]['role'] in ('system', 'developer') %}
    {{- '<|start|>developer<|message|># Instructions\n\n' + messages[0]['content'] + '<|end|>' }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + (message['content'] or '')
            + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""
