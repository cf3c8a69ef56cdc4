"""Helpers for the tests that talk to an in-process cluster with the official ``openai`` client.

``Clusters`` keeps one cluster per (model folder, mode) for a whole test module (starting one costs seconds) and
checks at the end what the ``serve`` fixture checks: every KV block free, nothing held by a worker, no stream left
at the router. ``model_folder`` copies the tiny model with another chat template (one that renders tools, tool
calls, names and ``enable_thinking``, as Qwen3's does) or a ``generation_config.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai

from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

MODES = ("disaggregated", "colocated")

# Qwen3's shape, small: tools in a system block, tool calls as Hermes <tool_call> JSON, tool results in
# <tool_response>, an empty think block when enable_thinking is false
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}"
    "{%- if message.name %} ({{ message.name }}){% endif %}\n"
    "{%- if message.role == 'tool' %}<tool_response id={{ message.tool_call_id }}>{{ message.content }}"
    "</tool_response>{%- else %}{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


def model_folder(
    source: Path, out: Path, chat_template: str | None = None, generation_config: dict | None = None
) -> Path:
    """A copy of the model folder ``source`` with another chat template and/or generation_config values."""
    from transformers import AutoTokenizer

    shutil.copytree(source, out)
    if chat_template is not None:
        tokenizer = AutoTokenizer.from_pretrained(out)
        tokenizer.chat_template = chat_template
        tokenizer.save_pretrained(out)
    if generation_config is not None:
        path = out / "generation_config.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**data, **generation_config}))
    return out


class Clusters:
    """In-process clusters started on first use, stopped (after the leak checks) by ``close``."""

    def __init__(self) -> None:
        self.handles: dict[tuple[str, str], object] = {}

    def get(self, model_path: Path, mode: str, **sections):
        from cluster.run.launch import start_serving

        key = (str(model_path), mode)
        if key not in self.handles:
            config = tiny_cluster_config(model_path, mode, **sections)
            self.handles[key] = start_serving(config, in_process=True)
        return self.handles[key]

    def close(self) -> None:
        errors = []
        for handle in self.handles.values():
            try:
                wait_all_kv_free(handle.base_url)
                assert not handle.router.flows, handle.router.flows
            except AssertionError as exc:
                errors.append(exc)
            finally:
                handle.stop()
        if errors:
            raise errors[0]


def client(handle) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def model_name(handle) -> str:
    return handle.config.served_model_name
