"""Chat-template fixtures for `train::chat` (tests/fixtures/chat/).

Records what transformers' `apply_chat_template` gives for a few Hugging Face-style chat
templates and conversations, so the Rust renderer (minijinja) and tokenization can be checked
against it:

- `tokenizer/`: the tiny byte-level BPE tokenizer of `tests/fixtures/llama/tokenizer` with the
  chat special tokens of the templates added (`<|im_start|>`, `<|eot_id|>`, ...), saved with
  `save_pretrained`;
- `templates/*.jinja`: the templates (ChatML with a default system prompt, Llama-3 style with
  `bos_token` and `raise_exception`, Mistral style with `loop.index0` and `.strip()`, Zephyr style
  with `loop.last`, and one using `tojson`);
- `chat.jsonl`, `chat-nested.parquet`, `chat-jsonstr.parquet`: the same three conversations as
  JSON lines, as Parquet with a `messages` column of `list<struct<role, content>>` (how Hugging
  Face datasets store chat data), and as Parquet with ShareGPT `conversations` stored as JSON
  text plus a nullable `system` column (pyarrow, snappy);
- `reference.json`: for every template x conversation x add_generation_prompt, the rendered text
  (`tokenize=False`) and the token ids (`tokenize=True`), or the error message the template
  raises.

Run from the repository root with the pinned stack (scripts/requirements-fixtures.txt):

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/make_chat_fixtures.py

(HF_HUB_OFFLINE=1: the saved tokenizer_config.json records `local_files_only`, so the files
are byte-identical only when it is set.)

Deterministic: rerunning reproduces every file byte for byte.
"""

import json
import os
import shutil
import sys

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "chat")
SRC_TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "llama", "tokenizer")

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
]

TEMPLATES = {
    # Qwen2-style ChatML with a default system prompt.
    "chatml": (
        "{% for message in messages %}"
        "{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Llama-3 style: bos_token, trim, raise_exception on roles other than user/assistant.
    "llama3": """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
    {{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles are supported after the system message, got ' + message['role']) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
""",
    # Mistral style: loop.index0 alternation check, .strip(), .startswith(), eos_token.
    "mistral": """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {% if message['content'].strip().startswith('!') %}{{ '[CMD]' }}{% endif %}
        {{ '[INST] ' + message['content'].strip() + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {{ ' ' + message['content'].strip() + eos_token }}
    {% endif %}
{% endfor %}
""",
    # Zephyr style: one line per message kept by trim_blocks, loop.last.
    "zephyr": """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}""",
    # tojson with transformers' semantics (no HTML escaping, non-ASCII kept, indent), split().
    "json": """{% for message in messages %}
{{ message | tojson }}|{{ message['content'].split(' ') | length }}
{% endfor %}
{% if add_generation_prompt %}
{{ {'role': 'assistant', 'tags': ['<a>', "it's"], 'n': 1} | tojson(indent=2) }}
{% endif %}""",
}

CONVERSATIONS = {
    "single": [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi! How can I help?"},
    ],
    "system_multi": [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "!And 3+3?"},
        {"role": "assistant", "content": " 6 "},
    ],
    "prompt_only": [
        {"role": "user", "content": "Write a haiku."},
    ],
    "unicode": [
        {"role": "user", "content": " caf\u00e9 \u2615 \"quoted\" <tag> & 'apostrophe' "},
        {"role": "assistant", "content": "na\u00efve \u00fcber \u65e5\u672c"},
    ],
    # Roles the Llama-3 template rejects.
    "tool_turn": [
        {"role": "user", "content": "Weather?"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ],
    # Special-token text inside content: tokenized as the special tokens (transformers does not
    # escape it).
    "special_in_content": [
        {"role": "user", "content": "Say <|im_end|> then <|eot_id|></s>"},
        {"role": "assistant", "content": "<|im_end|> then <|eot_id|></s>"},
    ],
    # Two turns of one role in a row (the Mistral template rejects them; `cpl` data reading
    # refuses them too, see train::chat::read_conversations).
    "same_role_twice": [
        {"role": "user", "content": "First question."},
        {"role": "user", "content": "Second question."},
        {"role": "assistant", "content": "Both answered."},
    ],
}

# OpenAI content parts: a list of {type: text, text} per message. `cpl` joins the text parts
# into one string when it reads data; a template written for parts (as multimodal checkpoints
# ship, e.g. Qwen2-VL's) renders them by concatenation, so both give the same text.
PARTS_TEMPLATE = """{% for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['content'] is string %}{{ message['content'] }}
{%- else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

PARTS_CONVERSATIONS = {
    "parts": [
        {"role": "user", "content": [
            {"type": "text", "text": "Look at "},
            {"type": "text", "text": "this cat."},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "A fine cat."}]},
    ],
    "parts_mixed": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
    ],
}


PARQUET_CONVERSATIONS = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "user", "content": "Two and two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "And three and three?"},
        {"role": "assistant", "content": "six"},
    ],
    [
        {"role": "user", "content": "caf\u00e9?"},
        {"role": "assistant", "content": "\u2615"},
    ],
]

SHAREGPT_ROLE = {"user": "human", "assistant": "gpt"}


def write_chat_files():
    with open(os.path.join(OUT, "chat.jsonl"), "w", encoding="utf-8") as f:
        for conv in PARQUET_CONVERSATIONS:
            f.write(json.dumps({"messages": conv}, ensure_ascii=False) + "\n")
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    table = pa.table(
        {
            "id": pa.array(range(len(PARQUET_CONVERSATIONS)), pa.int64()),
            "messages": pa.array(PARQUET_CONVERSATIONS, msg_type),
        }
    )
    pq.write_table(table, os.path.join(OUT, "chat-nested.parquet"), compression="snappy")
    systems, convs = [], []
    for conv in PARQUET_CONVERSATIONS:
        system = conv[0]["content"] if conv[0]["role"] == "system" else None
        turns = [m for m in conv if m["role"] != "system"]
        systems.append(system)
        convs.append(
            json.dumps(
                [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in turns],
                ensure_ascii=False,
            )
        )
    table = pa.table({"conversations": pa.array(convs, pa.string()), "system": pa.array(systems, pa.string())})
    pq.write_table(table, os.path.join(OUT, "chat-jsonstr.parquet"), compression="snappy")


def ids_of(result):
    if hasattr(result, "keys"):
        result = result["input_ids"]
    return [int(i) for i in result]


def main():
    # README.md is written by hand; everything else here is regenerated.
    for d in ("templates", "tokenizer"):
        shutil.rmtree(os.path.join(OUT, d), ignore_errors=True)
    os.makedirs(os.path.join(OUT, "templates"))
    tok = AutoTokenizer.from_pretrained(SRC_TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok_dir = os.path.join(OUT, "tokenizer")
    tok.save_pretrained(tok_dir)
    # Keep only what the Rust side reads.
    for f in os.listdir(tok_dir):
        if f not in ("tokenizer.json", "tokenizer_config.json"):
            os.remove(os.path.join(tok_dir, f))
    tok = AutoTokenizer.from_pretrained(tok_dir)

    cases = []
    for tname, src in TEMPLATES.items():
        with open(os.path.join(OUT, "templates", f"{tname}.jinja"), "w", encoding="utf-8") as f:
            f.write(src)
        for cname, conv in CONVERSATIONS.items():
            for gen in (False, True):
                case = {"template": tname, "conversation": cname, "add_generation_prompt": gen}
                try:
                    text = tok.apply_chat_template(
                        conv, chat_template=src, tokenize=False, add_generation_prompt=gen
                    )
                    ids = tok.apply_chat_template(
                        conv, chat_template=src, tokenize=True, add_generation_prompt=gen
                    )
                    case["text"] = text
                    case["ids"] = ids_of(ids)
                    # The same ids as tokenizing the text without special tokens.
                    assert case["ids"] == tok(text, add_special_tokens=False)["input_ids"]
                except jinja2.exceptions.TemplateError as e:
                    case["error"] = str(e)
                cases.append(case)

    with open(os.path.join(OUT, "templates", "parts.jinja"), "w", encoding="utf-8") as f:
        f.write(PARTS_TEMPLATE)
    parts_cases = []
    for cname, conv in PARTS_CONVERSATIONS.items():
        for gen in (False, True):
            text = tok.apply_chat_template(
                conv, chat_template=PARTS_TEMPLATE, tokenize=False, add_generation_prompt=gen
            )
            ids = ids_of(tok.apply_chat_template(
                conv, chat_template=PARTS_TEMPLATE, tokenize=True, add_generation_prompt=gen
            ))
            parts_cases.append(
                {"conversation": cname, "add_generation_prompt": gen, "text": text, "ids": ids}
            )

    write_chat_files()
    reference = {
        "generated_by": "scripts/make_chat_fixtures.py",
        "versions": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "jinja2": jinja2.__version__,
            "pyarrow": pa.__version__,
            "python": sys.version.split()[0],
        },
        "special_tokens": {
            k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)
        },
        "conversations": CONVERSATIONS,
        "parts_conversations": PARTS_CONVERSATIONS,
        "parts_cases": parts_cases,
        "cases": cases,
    }
    with open(os.path.join(OUT, "reference.json"), "w", encoding="utf-8") as f:
        # One case per line keeps the file small and diffable.
        head = {k: v for k, v in reference.items() if k != "cases"}
        text = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
        lines = [json.dumps(c, ensure_ascii=False) for c in cases]
        f.write(text + ',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    with open(os.path.join(OUT, "reference.json"), encoding="utf-8") as f:
        assert json.load(f) == reference
    n_err = sum("error" in c for c in cases)
    print(f"{len(cases)} cases ({n_err} raising) -> {OUT}")


if __name__ == "__main__":
    main()
