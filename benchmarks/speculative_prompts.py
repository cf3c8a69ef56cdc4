"""Prompts whose answers copy from their input (edit, fix, repeat, reformat, summarise): where n-gram proposals hit.

Written for ``pdserve bench engine --speculative``; each is one chat turn for an instruct model. Kept inline so the
benchmark needs no dataset download.
"""

from __future__ import annotations

CODE = '''def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """How many blocks hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size


def reserved_tokens(num_computed: int, remaining: int, headroom: int, max_model_len: int) -> int:
    """Tokens to reserve for a request that has computed num_computed tokens."""
    return min(num_computed + min(remaining, headroom or remaining), max_model_len)
'''

CONFIG = """model:
  name: SmolLM2-135M-Instruct
  max_model_len: 2048
pools:
  prefill:
    replicas: 1
    kv_memory_mb: 256
  decode:
    replicas: 2
    kv_memory_mb: 512
router:
  port: 8000
  policy: least_loaded
"""

PARAGRAPH = (
    "The decode worker keeps every running request in one batch. Each step it runs one forward pass over all of "
    "them, samples one token for each, and sends the tokens to the router. When a request finishes, its blocks go "
    "back to the free list, and the next waiting request can start. The prefill worker computes the prompt and "
    "ships its KV cache to the decode worker, so that a long prompt never stalls the requests that are decoding."
)

TYPOS = (
    "The routr sends each reqest to the worker with the most free blocks. If that worker dies, the reqest is sent "
    "again to another one, and the client never sees the faliure. The metrics show how many reqests were retried "
    "and how long each one waited in the queue befor it started."
)

ITEMS = "apples, 3, red\nbananas, 12, yellow\ncherries, 40, dark red\ndates, 7, brown\nelderberries, 25, black"

TASKS: list[str] = [
    f"Rename the function blocks_for_tokens to num_blocks everywhere in this code. Output the whole code.\n\n{CODE}",
    f"Repeat the following text exactly, word for word.\n\n{PARAGRAPH}",
    f"Fix the spelling mistakes in this paragraph and output the corrected paragraph.\n\n{TYPOS}",
    f"Change the decode replicas from 2 to 4 in this YAML file and output the whole file.\n\n{CONFIG}",
    f"Turn these lines into a Markdown table with the columns fruit, count and colour.\n\n{ITEMS}",
    f"Add a docstring line to each function in this code. Output the whole code.\n\n{CODE}",
    f"Rewrite this paragraph in the past tense.\n\n{PARAGRAPH}",
    f"Summarise this paragraph in two sentences, reusing its words.\n\n{TYPOS}",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` tasks (cycled) as token ids of one user turn and the assistant's header."""
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": TASKS[i % len(TASKS)]}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


def write_jsonl(path: str, output_tokens: int = 96) -> None:
    """The tasks as a ``pdserve bench serve --dataset-name jsonl`` file (sent as chat user messages)."""
    import json

    with open(path, "w") as f:
        for task in TASKS:
            f.write(json.dumps({"prompt": task, "output_tokens": output_tokens}) + "\n")


if __name__ == "__main__":  # python -m benchmarks.speculative_prompts grounded.jsonl
    import sys

    write_jsonl(sys.argv[1])
