"""Notebook parameters: CLI values parsed like papermill's `-p`, YAML parameter files, and the
check against the notebook's tagged `parameters` cell (names and value types) before a run."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from workbench.report.errors import ParameterError, UnknownParameters


def parse_value(text: str) -> Any:
    """A CLI parameter value, like papermill's -p: int, float, bool/null/list (YAML), else str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, (bool, list, dict)) or value is None else text


def load_parameters(
    files: list[str | Path] | None = None, pairs: list[tuple[str, str]] | None = None
) -> dict[str, Any]:
    """Merge YAML parameter files then `-p NAME VALUE` pairs (later wins)."""
    import yaml

    params: dict[str, Any] = {}
    for f in files or []:
        try:
            data = yaml.safe_load(Path(f).read_text(encoding="utf-8"))
        except OSError as e:
            raise ParameterError(f"parameters file {f}: cannot read it ({e.strerror})") from e
        except UnicodeDecodeError as e:
            raise ParameterError(f"parameters file {f}: not UTF-8 text ({e.reason})") from e
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ParameterError(
                f"parameters file {f}: malformed YAML{where} ({problem}); "
                "expected a mapping of NAME: VALUE lines"
            ) from e
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ParameterError(
                f"parameters file {f}: must hold a mapping of NAME: VALUE, "
                f"got a {type(data).__name__}"
            )
        params.update(data)
    for name, value in pairs or []:
        params[name] = parse_value(value)
    return params


def literal(source: Any) -> Any:
    """A parameters-cell default (source text) as a value when it is a plain literal."""
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError, TypeError):
        return source


def notebook_parameters(notebook: str | Path) -> dict[str, Any]:
    """The names (and defaults, as source text) defined in the notebook's tagged parameters cell."""
    import papermill as pm

    return {name: p.get("default") for name, p in pm.inspect_notebook(str(notebook)).items()}


def _type_problem(value: Any, default: Any) -> str | None:
    """Why `value` cannot stand where the notebook's default is `default` (None: it can).
    None is always accepted (notebooks use it for "the profile's value")."""
    if value is None or default is None or isinstance(default, str):
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "an integer"
    if isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else "a number"
    if isinstance(default, (list, tuple)):
        return None if isinstance(value, (list, tuple)) else "a list"
    return None


def validate_parameters(notebook: str | Path, parameters: dict[str, Any]) -> dict[str, Any]:
    """Refuse names the notebook does not declare (listing the ones it does) and values of
    another type than the declared default (`-p n_prompts abc` for `n_prompts = 16`), before
    anything runs; returns the declared defaults (source text)."""
    name = Path(notebook).name
    declared = notebook_parameters(notebook)
    unknown = sorted(set(parameters) - set(declared))
    if unknown:
        listing = (
            ", ".join(f"{k}={v}" for k, v in declared.items()) or "(no tagged parameters cell)"
        )
        raise UnknownParameters(
            f"{name}: unknown parameter(s) {', '.join(unknown)}; "
            f"the notebook's parameters are: {listing}"
        )
    for key, value in parameters.items():
        if expected := _type_problem(value, literal(declared[key])):
            raise ParameterError(
                f"{name}: parameter {key} must be {expected} (notebook default "
                f"{key} = {declared[key]}), got {value!r}"
            )
    return declared
