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
  `tools` become the developer message's `namespace functions { type NAME = (_: {...}) =>
  any; }` (parameters as TypeScript types), earlier calls `<|start|>assistant to=functions.NAME
  <|channel|>commentary json<|message|>ARGS<|call|>` and tool results `<|start|>functions.NAME
  to=assistant<|channel|>commentary<|message|>...<|end|>`, as gpt-oss's published template
  renders them (the function a result answers: the call its `tool_call_id` names, else the
  latest). Differences from it: no knowledge-cutoff or date lines, no built-in tools
  (browser, python), nested object types on one line, no `// default:` comments.
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

HARMONY_TEMPLATE = r"""
{#- a JSON schema as a TypeScript type, as gpt-oss's template writes parameters #}
{%- macro ts_type(spec) -%}
    {%- if spec['enum'] -%}
        {{- spec['enum'] | map('tojson') | join(' | ') }}
    {%- elif spec['type'] == 'string' -%}
        {{- 'string' }}
    {%- elif spec['type'] in ('number', 'integer') -%}
        {{- 'number' }}
    {%- elif spec['type'] == 'boolean' -%}
        {{- 'boolean' }}
    {%- elif spec['type'] == 'array' -%}
        {{- (ts_type(spec['items']) if spec['items'] else 'any') + '[]' }}
    {%- elif spec['type'] == 'object' and spec['properties'] -%}
        {{- '{' }}
        {%- for name, prop in spec['properties'].items() -%}
            {{- name + ('' if name in (spec['required'] or []) else '?') + ': ' + ts_type(prop)
                + (', ' if not loop.last else '') }}
        {%- endfor -%}
        {{- '}' }}
    {%- elif spec['type'] == 'object' -%}
        {{- 'object' }}
    {%- else -%}
        {{- 'any' }}
    {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model '
    'trained by OpenAI.\nReasoning: ' + (reasoning_effort | default('medium')) + '\n\n'
    '# Valid channels: analysis, commentary, final. Channel must be included for every '
    'message.' }}
{%- if tools %}
    {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
{%- endif %}
{{- '<|end|>' }}
{%- if messages and messages[0]['role'] in ('system', 'developer') %}
    {%- set instructions = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set instructions = '' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if instructions or tools %}
    {{- '<|start|>developer<|message|>' }}
    {%- if instructions %}
        {{- '# Instructions\n\n' + instructions + ('\n\n' if tools else '') }}
    {%- endif %}
    {%- if tools %}
        {{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' }}
        {%- for tool in tools %}
            {%- set fn = tool['function'] %}
            {%- if fn['description'] %}
                {{- '// ' + fn['description'] + '\n' }}
            {%- endif %}
            {%- set params = fn['parameters'] or {} %}
            {%- if params['properties'] %}
                {{- 'type ' + fn['name'] + ' = (_: {\n' }}
                {%- for name, prop in params['properties'].items() %}
                    {%- if prop['description'] %}
                        {{- '// ' + prop['description'] + '\n' }}
                    {%- endif %}
                    {{- name + ('' if name in (params['required'] or []) else '?') + ': '
                        + ts_type(prop) + ',\n' }}
                {%- endfor %}
                {{- '}) => any;\n\n' }}
            {%- else %}
                {{- 'type ' + fn['name'] + ' = () => any;\n\n' }}
            {%- endif %}
        {%- endfor %}
        {{- '} // namespace functions' }}
    {%- endif %}
    {{- '<|end|>' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] %}
        {#- the reasoning before a call stays while no answer followed it #}
        {%- set answered = namespace(found=false) %}
        {%- for later in loop_messages[loop.index:] %}
            {%- if later['role'] == 'assistant' and not later['tool_calls'] %}
                {%- set answered.found = true %}
            {%- endif %}
        {%- endfor %}
        {%- set thought = message['thinking'] or message['content'] %}
        {%- if thought and not answered.found %}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thought + '<|end|>' }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set fn = call['function'] or call %}
            {{- '<|start|>assistant to=functions.' + fn['name'] + '<|channel|>commentary json'
                '<|message|>' + (fn['arguments'] if fn['arguments'] is string
                                 else fn['arguments'] | tojson) + '<|call|>' }}
        {%- endfor %}
    {%- elif message['role'] == 'assistant' %}
        {{- '<|start|>assistant<|channel|>final<|message|>' + (message['content'] or '')
            + '<|end|>' }}
    {%- elif message['role'] == 'tool' %}
        {#- the function it answers: the call its tool_call_id names, else the latest call #}
        {%- set called = namespace(name='') %}
        {%- for earlier in loop_messages[:loop.index0] %}
            {%- for call in earlier['tool_calls'] or [] %}
                {%- if not message['tool_call_id'] or call['id'] == message['tool_call_id'] %}
                    {%- set called.name = (call['function'] or call)['name'] %}
                {%- endif %}
            {%- endfor %}
        {%- endfor %}
        {%- if not called.name %}
            {{- raise_exception('a tool message answers no earlier assistant tool call') }}
        {%- endif %}
        {{- '<|start|>functions.' + called.name + ' to=assistant<|channel|>commentary<|message|>'
            + (message['content'] if message['content'] is string
               else message['content'] | tojson) + '<|end|>' }}
    {%- else %}
        {{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start|>assistant' }}
{%- endif %}
"""
