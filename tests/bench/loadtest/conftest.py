from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def byte_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer folder (byte-level, with a chat template) for --tokenizer."""
    from engine.tiny_model import build_byte_tokenizer

    folder = tmp_path_factory.mktemp("byte-tokenizer")
    build_byte_tokenizer().save_pretrained(folder)
    return folder
