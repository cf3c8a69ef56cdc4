"""Workloads: the list of requests a run sends, each prompt built to an exact token count.

Counts are the server's, with the model's tokenizer: completions ``tokenizer(system + prompt)`` with special tokens
(a BOS counts); chat the templated conversation (template tokens and a default system prompt count).
``PromptBuilder`` draws "clean" token ids (their text re-encodes to themselves; words with a leading space where the
vocabulary has enough), decodes, re-counts, and trims or extends until the count is exact, or raises. Sources
(``--dataset-name``): ``random`` lengths; ``jsonl`` (``{"prompt", "output_tokens"}`` per line, sent as is);
``sharegpt`` (the first human turn, the first gpt turn's token count; shuffled with ``--seed``); ``shared-prefix``
(system prompts of ``--shared-prefix-len`` tokens taken in turn, each with a question). Files are cycled.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.loadtest.client import RequestSpec
from bench.loadtest.options import DATASETS, LENGTH_DISTS, PDSERVE_DEFAULT_MODEL

_WORD = re.compile(r"^ [A-Za-z]{2,}$")


def pdserve_model_folder(name: str) -> Path:
    """Where pdserve keeps a built-in model it has converted, its tokenizer included: ``$PDSERVE_CACHE/models/NAME``
    (engine.model_loader writes it; tests/bench/loadtest/test_imports.py keeps the two paths equal)."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "models" / name


def load_tokenizer(tokenizer: str | None = None, model: str | None = None):
    """``--tokenizer`` if given; else the ``--model`` folder if it is one; else the tokenizer pdserve saved with the
    built-in model named by ``model`` (``--model``, or a cluster config's ``model.name``) or, for any other name, with
    its default model (``PDSERVE_DEFAULT_MODEL``). The names are the caller's: nothing of pdserve is imported, so a
    built-in model pdserve has not converted on this machine yet is an error that says what to give instead."""
    from transformers import AutoTokenizer

    if tokenizer:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise ValueError(f"--tokenizer: {str(path)!r} does not exist (a local tokenizer or model folder)")
    elif model and Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
    else:
        name = model if model and (pdserve_model_folder(model) / "config.json").is_file() else PDSERVE_DEFAULT_MODEL
        path = pdserve_model_folder(name)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"no --tokenizer, and --model {model or name!r} is not a folder: the tokenizer would be that of "
                f"pdserve's built-in {name!r}, which is not converted on this machine ({path}; pdserve converts it "
                "the first time it serves it): give --tokenizer, a local tokenizer or model folder"
            )
    return AutoTokenizer.from_pretrained(str(path))


class PromptBuilder:
    def __init__(self, tokenizer, endpoint_type: str = "completions", seed: int = 0) -> None:
        if endpoint_type not in ("completions", "chat"):
            raise ValueError(f"--endpoint-type: {endpoint_type!r} is not one of completions, chat")
        self.tokenizer = tokenizer
        self.chat = endpoint_type == "chat"
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError("--endpoint-type chat: the tokenizer has no chat template to count tokens with")
        self.rng = np.random.default_rng(seed)
        self.vocab = self._clean_vocab()

    def _clean_vocab(self) -> np.ndarray:
        tok = self.tokenizer
        special = set(tok.all_special_ids)
        size = len(tok)
        candidates = [i for i in self.rng.permutation(size)[:8000].tolist() if i not in special]
        texts = tok.batch_decode([[i] for i in candidates])
        encoded = tok(texts, add_special_tokens=False)["input_ids"]
        clean = [
            (i, t)
            for i, t, e in zip(candidates, texts, encoded)
            if t and t.isprintable() and "\ufffd" not in t and e == [i]
        ]
        words = [i for i, t in clean if _WORD.match(t)]
        chosen = words if len(words) >= 100 else [i for i, _ in clean]
        if not chosen:
            raise ValueError("the tokenizer has no token that decodes to plain text and back")
        return np.array(sorted(chosen))

    def ids(self, prompt: str, system: str | None = None) -> list[int]:
        """The prompt's token ids as the server will see them (templated for chat, special tokens included)."""
        if self.chat:
            messages = ([{"role": "system", "content": system}] if system is not None else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer((system or "") + prompt, add_special_tokens=True)["input_ids"])

    def count(self, prompt: str, system: str | None = None) -> int:
        """Prompt tokens the server will see for this request."""
        return len(self.ids(prompt, system))

    def overhead(self, system: str | None = None) -> int:
        """Tokens of a request with an empty user text (template, BOS, system prompt)."""
        return self.count("", system)

    def random_text(self, n: int) -> str:
        """About ``n`` tokens (not exact; ``build_system`` is)."""
        return self.tokenizer.decode(self.rng.choice(self.vocab, size=max(n, 0)).tolist())

    def build_system(self, n: int) -> str:
        """A text of exactly ``n`` tokens on its own (no special tokens), e.g. a shared system prompt."""
        return self._fit(n, lambda text: len(self.tokenizer(text, add_special_tokens=False)["input_ids"]))

    def build(self, target: int, system: str | None = None) -> str:
        """A user text such that ``count(text, system) == target`` exactly."""
        base = self.overhead(system)
        if target <= base:
            raise ValueError(
                f"a prompt of {target} tokens cannot be built: the request alone (template, system prompt) already "
                f"takes {base}; ask for more than {base} input tokens"
            )
        return self._fit(target, lambda text: self.count(text, system), start=target - base)

    def _fit(self, target: int, count, start: int | None = None) -> str:
        for _attempt in range(8):
            ids = self.rng.choice(self.vocab, size=start if start is not None else target).tolist()
            for _step in range(64):
                text = self.tokenizer.decode(ids)
                have = count(text)
                if have == target:
                    return text
                if have > target:
                    ids = ids[: max(1, len(ids) - (have - target))]
                else:
                    ids += self.rng.choice(self.vocab, size=target - have).tolist()
        raise ValueError(f"could not build a prompt of exactly {target} tokens with this tokenizer")


def draw_lengths(
    mean: int, n: int, dist: str, rng: np.random.Generator, range_ratio: float = 0.0, cv: float = 0.25, minimum: int = 1
) -> list[int]:
    """Uniform lengths lie in [mean(1-r), mean(1+r)]; normal and lognormal have std ``cv * mean`` (the lognormal
    keeps the mean). Clipped below at ``minimum``."""
    if mean < 1:
        raise ValueError(f"a length must be at least 1 (got {mean})")
    if dist == "fixed":
        values = np.full(n, float(mean))
    elif dist == "uniform":
        low, high = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
        values = rng.integers(low, high + 1, size=n).astype(float)
    elif dist == "normal":
        values = rng.normal(mean, cv * mean, size=n)
    elif dist == "lognormal":
        sigma2 = math.log(1 + cv * cv)
        values = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), size=n)
    else:
        raise ValueError(f"--length-dist: {dist!r} is not one of {', '.join(LENGTH_DISTS)}")
    return [max(minimum, int(round(v))) for v in values]


@dataclass(slots=True)
class WorkloadSettings:
    dataset_name: str = "random"
    dataset_path: str | None = None
    random_input_len: int = 256
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    length_dist: str | None = None  # None: uniform when random_range_ratio > 0, else fixed
    length_cv: float = 0.25
    shared_prefix_groups: int = 4
    shared_prefix_len: int = 512
    seed: int = 0

    @property
    def dist(self) -> str:
        if self.length_dist:
            return self.length_dist
        return "uniform" if self.random_range_ratio > 0 else "fixed"


def build_requests(settings: WorkloadSettings, builder: PromptBuilder, n: int) -> list[RequestSpec]:
    if n < 1:
        raise ValueError("a run needs at least one request")
    rng = np.random.default_rng(settings.seed)
    name = settings.dataset_name
    if name == "random":
        minimum = builder.overhead() + 1
        inputs = draw_lengths(
            settings.random_input_len, n, settings.dist, rng, settings.random_range_ratio, settings.length_cv, minimum
        )
        outputs = draw_lengths(
            settings.random_output_len, n, settings.dist, rng, settings.random_range_ratio, settings.length_cv
        )
        return [RequestSpec(i, builder.build(inputs[i]), outputs[i], inputs[i]) for i in range(n)]
    if name == "shared-prefix":
        if settings.shared_prefix_groups < 1 or settings.shared_prefix_len < 1:
            raise ValueError("--shared-prefix-groups and --shared-prefix-len must be at least 1")
        prefixes = [builder.build_system(settings.shared_prefix_len) for _ in range(settings.shared_prefix_groups)]
        if not builder.chat:
            prefixes = [p + "\n" for p in prefixes]
        bases = [builder.overhead(p) for p in prefixes]
        questions = draw_lengths(
            settings.random_input_len, n, settings.dist, rng, settings.random_range_ratio, settings.length_cv
        )
        outputs = draw_lengths(
            settings.random_output_len, n, settings.dist, rng, settings.random_range_ratio, settings.length_cv
        )
        specs = []
        for i in range(n):
            g = i % settings.shared_prefix_groups
            target = bases[g] + questions[i]
            specs.append(RequestSpec(i, builder.build(target, prefixes[g]), outputs[i], target, prefixes[g], g))
        return specs
    if name in ("jsonl", "sharegpt"):
        if not settings.dataset_path:
            raise ValueError(f"--dataset-name {name} needs --dataset-path")
        path = Path(settings.dataset_path).expanduser()
        if not path.is_file():
            raise ValueError(f"--dataset-path: {str(path)!r} is not a file")
        pairs = _read_jsonl(path, settings) if name == "jsonl" else _read_sharegpt(path, builder, rng)
        if not pairs:
            raise ValueError(f"--dataset-path: {str(path)!r} holds no usable prompt")
        specs = []
        for i in range(n):
            prompt, output = pairs[i % len(pairs)]
            specs.append(RequestSpec(i, prompt, output, builder.count(prompt)))
        return specs
    raise ValueError(f"--dataset-name: {name!r} is not one of {', '.join(DATASETS)}")


def _read_jsonl(path: Path, settings: WorkloadSettings) -> list[tuple[str, int]]:
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            output = int(row.get("output_tokens", settings.random_output_len))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f'{path}:{number}: expected {{"prompt": str, "output_tokens": int}} ({exc})') from None
        if not isinstance(prompt, str) or not prompt or output < 1:
            raise ValueError(f"{path}:{number}: prompt must be a non-empty string and output_tokens at least 1")
        pairs.append((prompt, output))
    return pairs


def _read_sharegpt(path: Path, builder: PromptBuilder, rng: np.random.Generator) -> list[tuple[str, int]]:
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f'{path}: a ShareGPT file is a JSON list of {{"conversations": [...]}}')
    pairs = []
    for row in data:
        turns = (row.get("conversations") or row.get("conversation") or []) if isinstance(row, dict) else []
        human = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        gpt = next((t.get("value") for t in turns if t.get("from") in ("gpt", "assistant", "chatgpt")), None)
        if not human or not gpt:
            continue
        output = len(builder.tokenizer(gpt, add_special_tokens=False)["input_ids"])
        if output >= 1:
            pairs.append((human, output))
    order = rng.permutation(len(pairs)).tolist()
    return [pairs[i] for i in order]
