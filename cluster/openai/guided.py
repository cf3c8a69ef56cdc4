"""From a chat request's ``response_format`` / ``tools`` / ``tool_choice`` to a grammar and a ``GuidedPlan``.

The fields arrive as plain JSON, so every refusal names the field as the client spelled it
(``tools[2].function.parameters``). The caller's ``compile_check`` compiles the grammar, so a schema xgrammar cannot
handle is refused before any worker sees it. Tool choices, as in vLLM:
- ``none``: no grammar, and the template is not offered the tools;
- ``auto`` (the default with tools): no grammar; Hermes ``<tool_call>{..}</tool_call>`` blocks are read as calls;
- ``required``: a JSON array (at least one item) of ``{"name": <a tool>, "parameters": {..}}``;
- a named function: that function's arguments (its ``parameters`` schema).
"""

from __future__ import annotations

import copy
import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.request import GuidedDecoding

CompileCheck = Callable[[GuidedDecoding], object]  # raises ValueError (GrammarError) for a spec that does not compile
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function and schema names
_ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without ``parameters`` takes any JSON object
_DEFS_KEYS = ("$defs", "definitions")  # where JSON schemas keep the targets of their "#/$defs/..." references


class GuidedRequestError(ValueError):
    """A 400 naming ``param`` as the client wrote it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ToolMode(str, enum.Enum):
    NONE = "none"  # no tools in play (none given, or tool_choice "none"): the text is the content
    AUTO = "auto"  # the model may call tools: Hermes <tool_call> blocks are parsed out of the text
    REQUIRED = "required"  # the text is a JSON array of {"name", "parameters"}
    NAMED = "named"  # the text is the named function's arguments


@dataclass(frozen=True, slots=True)
class GuidedPlan:
    """The grammar (None: free text), the tools the template offers, and how the output is read back."""

    guided: GuidedDecoding | None = None
    tool_mode: ToolMode = ToolMode.NONE
    template_tools: list[dict[str, Any]] | None = None  # the client's tool dicts, for apply_chat_template(tools=)
    function_name: str | None = None  # NAMED: the function every answer calls
    parallel_tool_calls: bool = True  # False: at most one call (REQUIRED: maxItems 1; AUTO: the first one only)

    @property
    def calls_tools(self) -> bool:
        return self.tool_mode != ToolMode.NONE


def plan_chat(
    *,
    response_format: Any = None,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: Any = None,
    compile_check: CompileCheck | None = None,
) -> GuidedPlan:
    """Raises GuidedRequestError. ``None``: the field was not sent, or was null (the spec allows it for all four)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise GuidedRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    functions = _parse_tools(tools)
    mode, name = _parse_tool_choice(tool_choice, functions)
    if mode == ToolMode.NONE:
        return GuidedPlan(guided=response_format_grammar(response_format, compile_check), parallel_tool_calls=parallel)
    if response_format_grammar(response_format, None) is not None:
        raise GuidedRequestError(
            "response_format cannot be combined with tools (unless tool_choice is 'none'): both decide the text",
            "response_format",
        )
    template_tools = [copy.deepcopy(tool) for tool in tools]
    if mode == ToolMode.AUTO:
        return GuidedPlan(None, mode, template_tools, parallel_tool_calls=parallel)
    if mode == ToolMode.NAMED:
        index, params = next((i, f.parameters) for i, f in enumerate(functions) if f.name == name)
        guided = GuidedDecoding("json_schema", json.dumps(params))
        _check(compile_check, guided, f"tools[{index}].function.parameters")
        return GuidedPlan(guided, mode, template_tools, name, parallel)
    guided = GuidedDecoding("json_schema", json.dumps(required_schema(functions, parallel)))
    if compile_check is not None:
        try:
            compile_check(guided)
        except ValueError as e:  # name the tool whose parameters are at fault, when one is on its own
            for i, function in enumerate(functions):
                _check(compile_check, GuidedDecoding("json_schema", json.dumps(function.parameters)), _params(i))
            raise GuidedRequestError(f"tools: the tool_choice 'required' grammar does not compile: {e}", "tools") from e
    return GuidedPlan(guided, mode, template_tools, parallel_tool_calls=parallel)


def response_format_grammar(response_format: Any, compile_check: CompileCheck | None = None) -> GuidedDecoding | None:
    """The grammar (None for text or absent); takes what ``chat.completions.parse(response_format=Model)`` sends."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GuidedRequestError("response_format must be an object with a 'type'", "response_format")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise GuidedRequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {_short(kind)}",
            "response_format.type",
        )
    _no_unknown_keys(response_format, allowed[kind], "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        guided = GuidedDecoding("json_object", "")
        _check(compile_check, guided, "response_format")
        return guided
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise GuidedRequestError(
            "response_format.json_schema must be an object with a 'name'", "response_format.json_schema"
        )
    _no_unknown_keys(spec, {"name", "description", "schema", "strict"}, "response_format.json_schema")
    _check_name(spec.get("name"), "response_format.json_schema.name")
    _optional(spec, "description", str, "a string", "response_format.json_schema")
    _optional(spec, "strict", bool, "a boolean", "response_format.json_schema")
    schema = _ANY_OBJECT if spec.get("schema") is None else spec["schema"]  # optional in the spec: any JSON object
    if not isinstance(schema, dict):
        raise GuidedRequestError("response_format.json_schema.schema must be a JSON schema object", _SCHEMA_PARAM)
    guided = GuidedDecoding("json_schema", json.dumps(schema))
    _check(compile_check, guided, _SCHEMA_PARAM)
    return guided


_SCHEMA_PARAM = "response_format.json_schema.schema"


@dataclass(frozen=True, slots=True)
class _Function:
    name: str
    parameters: dict[str, Any]


def _parse_tools(tools: Any) -> list[_Function]:
    if tools is None:
        return []
    if not isinstance(tools, list) or not tools:
        raise GuidedRequestError("tools must be a non-empty array of function tools", "tools")
    functions: list[_Function] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise GuidedRequestError(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise GuidedRequestError(
                f"{where}.type must be 'function', got {_short(tool.get('type'))}", f"{where}.type"
            )
        _no_unknown_keys(tool, {"type", "function"}, where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise GuidedRequestError(f"{where}.function must be an object", f"{where}.function")
        _no_unknown_keys(function, {"name", "description", "parameters", "strict"}, f"{where}.function")
        name = _check_name(function.get("name"), f"{where}.function.name")
        if name in seen:
            raise GuidedRequestError(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        _optional(function, "description", str, "a string", f"{where}.function")
        _optional(function, "strict", bool, "a boolean", f"{where}.function")
        parameters = _ANY_OBJECT if function.get("parameters") is None else function["parameters"]
        if not isinstance(parameters, dict):
            raise GuidedRequestError(f"{_params(i)} must be a JSON schema object", _params(i))
        functions.append(_Function(name, parameters))
    return functions


def _parse_tool_choice(tool_choice: Any, functions: list[_Function]) -> tuple[ToolMode, str | None]:
    if tool_choice is None:
        return (ToolMode.AUTO if functions else ToolMode.NONE), None
    if tool_choice == "none":
        return ToolMode.NONE, None
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise GuidedRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {_short(tool_choice)}",
                "tool_choice",
            )
        if not functions:
            raise GuidedRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ToolMode(tool_choice), None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise GuidedRequestError(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    _no_unknown_keys(tool_choice, {"type", "function"}, "tool_choice")
    function = tool_choice.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise GuidedRequestError("tool_choice.function.name must be a string", "tool_choice.function.name")
    _no_unknown_keys(function, {"name"}, "tool_choice.function")
    name = function["name"]
    if name not in {f.name for f in functions}:
        raise GuidedRequestError(
            f"tool_choice.function.name {name!r} is not one of the tools", "tool_choice.function.name"
        )
    return ToolMode.NAMED, name


def required_schema(functions: list[_Function], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required", as vLLM builds it. Each tool's ``$defs`` move to the root, where its "#/$defs/..."
    references point once the parameters sit inside the array."""
    defs: dict[str, Any] = {}
    alternatives = []
    for i, function in enumerate(functions):
        params = copy.deepcopy(function.parameters)
        for key in _DEFS_KEYS:
            for def_name, definition in (params.pop(key, None) or {}).items():
                slot = f"{key}/{def_name}"
                if slot in defs and defs[slot] != definition:
                    raise GuidedRequestError(
                        f"{_params(i)}: {key} {def_name!r} differs from another tool's with the same name", _params(i)
                    )
                defs[slot] = definition
        alternatives.append(
            {"properties": {"name": {"const": function.name}, "parameters": params}, "required": ["name", "parameters"]}
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    for slot, definition in defs.items():
        key, def_name = slot.split("/", 1)
        schema.setdefault(key, {})[def_name] = definition
    return schema


def _check(compile_check: CompileCheck | None, guided: GuidedDecoding, param: str) -> None:
    if compile_check is None:
        return
    try:
        compile_check(guided)
    except ValueError as e:
        raise GuidedRequestError(f"{param}: {e}", param) from e


def _check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise GuidedRequestError(f"{param} must be 1 to 64 letters, digits, '_' or '-'", param)
    return name


def _no_unknown_keys(value: dict, known: set[str], where: str) -> None:
    for key in value:
        if key not in known:
            raise GuidedRequestError(f"{where}.{key} is not supported", f"{where}.{key}")


def _optional(value: dict, key: str, kind: type, what: str, where: str) -> None:
    if value.get(key) is not None and not isinstance(value[key], kind):
        raise GuidedRequestError(f"{where}.{key} must be {what}", f"{where}.{key}")


def _params(i: int) -> str:
    return f"tools[{i}].function.parameters"


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
