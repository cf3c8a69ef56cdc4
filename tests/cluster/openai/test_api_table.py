"""docs/api.md's parameter table is what the server does: a walk over HTTP, and a check against the code and the spec.

The table (between ``<!-- api-table:begin -->`` and ``<!-- api-table:end -->``) lists every request parameter of
``/v1/chat/completions`` and ``/v1/completions`` with its status. This module parses it and checks:

- the table against the request models (``cluster/openai/openai_schema.py``): every field they have, and every field of a
  model nested one level down (``stream_options.*``, ``messages[].*``), has a row; every row the table calls
  ``supported`` or ``accepted`` is a field of them;
- the table against the OpenAI spec, as the official ``openai`` client's request types define it: every parameter
  of both endpoints (and of ``stream_options``) has a row;
- the table against the server, over HTTP on one in-process cluster (colocated: the walk checks the edge, which is
  the same in both modes): ``supported`` / ``accepted`` examples answer 200, ``refused`` / ``limit`` examples answer
  400 with ``error.param`` naming the parameter, every ``neutral`` value answers 200, ``null`` answers 200 for every
  parameter the spec lets be null, and an unknown parameter is "Unrecognized request argument";
- the response table: every field of real responses (streamed and not, with logprobs, usage, tool calls) is
  documented, and every documented field occurs.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from cluster.openai.openai_schema import ChatRequest, CompletionRequest
from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[3] / "docs" / "api.md"
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
STATUSES = {"supported", "accepted", "refused", "limit"}
REQUIRED = {"model", "messages", "prompt"}  # in every walked request already
MAX_TOKENS = 4


@dataclass(frozen=True)
class Row:
    endpoint: str  # "chat" or "completions" ("both" rows are expanded)
    parameter: str
    status: str
    example: object
    with_: dict
    neutral: object  # _NONE when the cell is empty
    line: int

    @property
    def top(self) -> str:
        """The top-level field the parameter lives in (the example is its value)."""
        return re.split(r"[.\[]", self.parameter, maxsplit=1)[0]

    @property
    def id(self) -> str:
        return f"{self.endpoint}:{self.parameter}:{self.status}:L{self.line}"


_NONE = object()


def _section(text: str, name: str) -> tuple[str, int]:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    start = text.index(begin) + len(begin)
    return text[start : text.index(end)], text[:start].count("\n")


def _definitions(text: str) -> dict:
    block, _ = _section(text, "api-definitions")
    return json.loads(block.strip().removeprefix("```json").removesuffix("```"))


def _cells(line: str) -> list[str]:
    """A markdown table row's cells (no cell of the table holds a ``|``)."""
    return [cell.strip() for cell in line.strip()[1:-1].split("|")]


def _json_cell(cell: str, definitions: dict, where: str):
    if not cell:
        return _NONE
    assert cell.startswith("`") and cell.endswith("`"), f"{where}: a JSON cell is one code span: {cell!r}"
    text = re.sub(r"\$([A-Z_]+)", lambda m: json.dumps(definitions[m.group(1)]), cell[1:-1])
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AssertionError(f"{where}: not JSON: {cell!r} ({exc})") from None


def parse_table(text: str) -> list[Row]:
    definitions = _definitions(text)
    block, first_line = _section(text, "api-table")
    lines = [(first_line + i, line) for i, line in enumerate(block.splitlines()) if line.startswith("|")]
    head = _cells(lines[0][1])
    assert head == ["endpoint", "parameter", "status", "example (JSON)", "with (JSON)", "neutral (JSON)", "notes"]
    rows = []
    for number, line in lines[2:]:
        cells = _cells(line)
        where = f"docs/api.md:{number + 1}"
        assert len(cells) == len(head), f"{where}: {len(cells)} cells"
        endpoint, parameter, status, example, with_, neutral, _notes = cells
        assert endpoint in ("chat", "completions", "both"), where
        assert status in STATUSES, where
        assert parameter.startswith("`") and parameter.endswith("`"), where
        example_value = _json_cell(example, definitions, where)
        assert example_value is not _NONE, f"{where}: every row has an example"
        with_value = _json_cell(with_, definitions, where)
        with_value = {} if with_value is _NONE else with_value
        assert isinstance(with_value, dict), where
        for name in ("chat", "completions") if endpoint == "both" else (endpoint,):
            rows.append(
                Row(
                    name,
                    parameter[1:-1],
                    status,
                    example_value,
                    with_value,
                    _json_cell(neutral, definitions, where),
                    number + 1,
                )
            )
    return rows


def parse_responses(text: str) -> list[tuple[str, str]]:
    block, _ = _section(text, "api-response")
    lines = [line for line in block.splitlines() if line.startswith("|")]
    assert _cells(lines[0]) == ["response", "field", "notes"]
    return [(cells[0], cells[1].strip("`")) for cells in map(_cells, lines[2:])]


TEXT = DOC.read_text()
ROWS = parse_table(TEXT)
RESPONSE_FIELDS = parse_responses(TEXT)


def _status_of(endpoint: str) -> dict[str, set[str]]:
    """parameter -> the statuses its rows give (limit rows aside)."""
    out: dict[str, set[str]] = {}
    for row in ROWS:
        if row.endpoint == endpoint and row.status != "limit":
            out.setdefault(row.parameter, set()).add(row.status)
    return out


# ---- the table against the code and the spec ------------------------------------------------------------------


def _listed(endpoint: str) -> set[str]:
    """The parameters the table has rows for, and the fields holding them (``stream_options`` for its sub-fields)."""
    mine = [r for r in ROWS if r.endpoint == endpoint]
    return {r.parameter for r in mine} | {r.top for r in mine}


def _nested_models(annotation) -> list[tuple[str, type[BaseModel]]]:
    """('', Model) for a model field, ('[]', Model) for a list of models, through unions and Optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    found = []
    origin = typing.get_origin(annotation)
    for arg in typing.get_args(annotation):
        for suffix, model in _nested_models(arg):
            found.append((("[]" if origin is list else "") + suffix, model))
    return found


def _model_parameters(model: type[BaseModel]) -> set[str]:
    """The model's fields, and the fields of the models nested one level down, as the table names them."""
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        for suffix, nested in _nested_models(field.annotation):
            names.update(f"{name}{suffix}.{sub}" for sub in nested.model_fields)
    return names


MODELS = {"chat": ChatRequest, "completions": CompletionRequest}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_field_the_server_knows_has_a_row_and_every_supported_row_is_a_field(endpoint):
    fields = _model_parameters(MODELS[endpoint])
    statuses = _status_of(endpoint)
    assert fields - _listed(endpoint) == set(), "fields of the request model that docs/api.md does not list"
    supported = {name for name, s in statuses.items() if s & {"supported", "accepted"}}
    assert supported - fields == set(), "rows docs/api.md calls supported that the request model does not have"
    both = {name for name, s in statuses.items() if len(s) > 1}
    allowed_mixed = {name for name in both if "[]" in name}  # messages[].role: some roles supported, one refused
    assert both == allowed_mixed, f"a parameter is both supported and refused: {both - allowed_mixed}"


def _spec_parameters(endpoint: str) -> dict[str, bool]:
    """The official client's request parameters for the endpoint -> whether the spec lets them be null."""
    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat
    from openai.types.chat.chat_completion_stream_options_param import ChatCompletionStreamOptionsParam

    params = (chat if endpoint == "chat" else completions).CompletionCreateParamsNonStreaming
    out = {}
    for name, hint in typing.get_type_hints(params, include_extras=True).items():
        required = typing.get_origin(hint) is typing.Required
        out[name] = not required and type(None) in typing.get_args(hint)
    for name in ChatCompletionStreamOptionsParam.__annotations__:
        out[f"stream_options.{name}"] = False
    return out


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_parameter_of_the_openai_spec_has_a_row(endpoint):
    assert set(_spec_parameters(endpoint)) - _listed(endpoint) == set()


def test_the_table_is_well_formed():
    assert len({(r.endpoint, r.parameter, r.status, json.dumps(r.example)) for r in ROWS}) == len(ROWS)
    for row in ROWS:
        if "." in row.parameter or "[" in row.parameter:  # nested: the example is the top-level field's value
            assert row.top in ("stream_options", "messages"), row.id
        if row.top == "stream_options":
            assert row.parameter.split(".", 1)[1] in row.example, row.id
        if row.status == "limit":  # a value out of range of a parameter that is supported
            assert "supported" in _status_of(row.endpoint).get(row.parameter, set()), row.id


# ---- the table against the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    handle = start_serving(tiny_cluster_config(tiny_llama_path, mode="colocated"), in_process=True)
    try:
        yield handle
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
    finally:
        handle.stop()


def _body(server, endpoint: str, fields: dict) -> dict:
    body: dict = {"model": server.config.served_model_name, "max_tokens": MAX_TOKENS}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Once upon a time"
    if "max_completion_tokens" in fields:
        del body["max_tokens"]
    body.update(fields)
    return body


def _post(server, endpoint: str, fields: dict) -> tuple[int, dict | list[dict]]:
    """(status, the JSON body) for a plain answer; (status, the list of chunks) for a stream, which must end with
    [DONE] and hold no error event."""
    response = httpx.post(server.base_url + ENDPOINTS[endpoint], json=_body(server, endpoint, fields), timeout=60)
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return response.status_code, response.json()
    events = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-300:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks
    return response.status_code, chunks


def _fields(row: Row, value) -> dict:
    return {**row.with_, row.top: value}


def _names(param: str | None, parameter: str) -> bool:
    """``error.param`` names the row's parameter: it, or a field inside it (logit_bias.99999999, stop_token_ids[0]).
    For a message field (``messages[].content[].image_url``) the indices are the client's (``messages[0]...``) and the
    field or the part holding it will do (``messages[0].content[0]``), not the bare message."""
    if param is None:
        return False
    if "[]" not in parameter:
        return param == parameter or param.startswith((parameter + ".", parameter + "["))
    steps = re.findall(r"\[\]|\.?[^.\[]+", parameter)  # "messages", "[]", ".content", "[]", ".image_url"
    prefixes = ["".join(steps[:k]) for k in range(3, len(steps) + 1)]  # deeper than messages[]
    patterns = [re.escape(p).replace(r"\[\]", r"\[\d+\]") for p in prefixes]
    return any(re.fullmatch(pattern + r"((\.|\[).*)?", param) for pattern in patterns)


WALKED = [r for r in ROWS if r.parameter != "model"]  # every walked request carries the served model already


@pytest.mark.parametrize("row", WALKED, ids=[r.id for r in WALKED])
def test_each_row_answers_as_the_table_says(server, row):
    status, body = _post(server, row.endpoint, _fields(row, row.example))
    if row.status in ("supported", "accepted"):
        assert status == 200, (row.id, body)
        choices = [c for chunk in body for c in chunk["choices"]] if isinstance(body, list) else body["choices"]
        assert choices, (row.id, body)
    else:
        assert status == 400, (row.id, status, body)
        error = body["error"]
        assert _names(error["param"], row.parameter), (row.id, error)
    if row.neutral is not _NONE:
        status, body = _post(server, row.endpoint, _fields(row, row.neutral))
        assert status == 200, (row.id, "neutral", body)


NULLABLE = [
    (endpoint, name)
    for endpoint in ("chat", "completions")
    for name, nullable in _spec_parameters(endpoint).items()
    if nullable and "." not in name
]


@pytest.mark.parametrize("endpoint, name", NULLABLE, ids=[f"{e}:{n}" for e, n in NULLABLE])
def test_null_is_accepted_wherever_the_spec_allows_it(server, endpoint, name):
    status, body = _post(server, endpoint, {name: None})
    assert status == 200, body


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_an_unknown_parameter_is_an_unrecognized_argument(server, endpoint):
    status, body = _post(server, endpoint, {"temperatur": 0.5})
    assert status == 400
    assert body["error"]["param"] == "temperatur"
    assert body["error"]["message"].startswith("Unrecognized request argument")


# ---- the response table -------------------------------------------------------------------------------------


def _paths(value, prefix: str = "") -> set[str]:
    """Every field path in a JSON value: ``choices[].message.content``."""
    out = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            out.add(path)
            out |= _paths(item, path)
    elif isinstance(value, list):
        for item in value:
            out |= _paths(item, prefix + "[]")
    return out


def _covers(field: str, path: str) -> bool:
    return path == field or path.startswith((field + ".", field + "["))


def test_every_response_field_is_documented_and_every_documented_field_occurs(server):
    tools = _definitions(TEXT)["TOOLS"]
    requests = [
        ("chat", {"logprobs": True, "top_logprobs": 2}),
        ("chat", {"stream": True, "stream_options": {"include_usage": True}, "logprobs": True}),
        ("chat", {"tools": tools, "tool_choice": "required", "max_tokens": 64}),
        ("chat", {"tools": tools, "tool_choice": "required", "max_tokens": 64, "stream": True}),
        ("completions", {"logprobs": 2, "echo": True, "n": 2}),
        ("completions", {"stream": True, "stream_options": {"include_usage": True}}),
    ]
    seen: dict[str, set[str]] = {}  # object -> the paths its responses had
    for endpoint, fields in requests:
        status, body = _post(server, endpoint, fields)
        assert status == 200, (fields, body)
        for obj in body if isinstance(body, list) else [body]:
            seen.setdefault(obj["object"], set()).update(_paths(obj))
    for kind, paths in seen.items():
        documented = [field for response, field in RESPONSE_FIELDS if response in ("all", kind)]
        undocumented = {p for p in paths if not any(_covers(f, p) for f in documented)}
        assert undocumented == set(), f"{kind}: fields docs/api.md does not list"
    for response, field in RESPONSE_FIELDS:
        kinds = seen if response == "all" else {response: seen.get(response, set())}
        assert any(field in paths for paths in kinds.values()), f"{response} {field}: documented, never returned"
