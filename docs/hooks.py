"""MkDocs hook: the reference pages and the tables that come from the code, written at build time.

``on_files`` adds the generated pages (they exist only in the build):

* ``reference/cli.md``: every command's ``--help``, from
  :func:`kvprefetch.controlplane.cli.build_parser`;
* ``reference/configuration.md``: every field of the ``kvprefetch serve`` config, the
  scheduler's :class:`ServiceConfig` and the modelled :class:`FleetConfig`, with its type,
  default and the ``#:`` comment above it in the source;
* ``reference/http-api.md``: the paths, methods, request and response schemas of the
  OpenAPI document that :func:`kvprefetch.controlplane.live.http_api.create_app` serves;
* ``reference/metrics.md``: the Prometheus metrics the service and the gateway export.

``on_page_markdown`` fills the markers ``<!-- gen:NAME -->`` in hand-written pages (the
policy table, the stop-reason vocabulary, ...) and re-renders the result tables between
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` from ``docs/results/data/*.json``
(``python docs/results/generate.py`` writes the same tables into the page files).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
HELP_WIDTH = "100"


# --------------------------------------------------------------------------- text helpers

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


def _plain(text: str) -> str:
    """Sphinx markup of a docstring or comment as Markdown: roles to code, ``x`` to `x`."""

    def role(match: re.Match[str]) -> str:
        target = match.group(1)
        whole = match.group(0)
        shown = target.rsplit(".", 1)[-1] if "`~" in whole else target
        return f"`{shown}`"

    text = _ROLE.sub(role, text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    """One Markdown table cell: one line, pipes escaped outside code spans (inside them the
    table parser leaves pipes alone, and an escape would show)."""
    line = " ".join(_plain(text).split())
    return re.sub(r"(`[^`]*`)|\|", lambda m: m.group(1) or "\\|", line)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# --------------------------------------------------------------------------- CLI reference


def _subcommands(parser: argparse.ArgumentParser,
                 prefix: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``kvprefetch sim``, parser) for every sub-command, depth first, aliases once."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            full = f"{prefix} {name}"
            yield full, sub
            yield from _subcommands(sub, full)


def cli_commands() -> list[tuple[str, argparse.ArgumentParser]]:
    from kvprefetch.controlplane.cli import build_parser

    parser = build_parser()
    return [("kvprefetch", parser), *_subcommands(parser, "kvprefetch")]


def cli_page() -> str:
    os.environ["COLUMNS"] = HELP_WIDTH  # argparse wraps help to the terminal's width
    commands = cli_commands()
    lines = [
        "# CLI reference",
        "",
        "Generated at build time from the argument parsers of the installed `kvprefetch` "
        "(`kvprefetch.controlplane.cli.build_parser()`): each section is the command's "
        "`--help`, as a terminal shows it.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    helps = _short_helps()
    for name, _parser in commands[1:]:
        lines.append(f"| [`{name}`](#{_anchor(name)}) | {_cell(helps.get(name, ''))} |")
    lines.append("")
    for name, parser in commands:
        lines += [f"## `{name}` {{ #{_anchor(name)} }}", "", "```text",
                  parser.format_help().rstrip(), "```", ""]
    return "\n".join(lines)


def _short_helps() -> dict[str, str]:
    """``kvprefetch sim`` -> the one-line help its parent lists it with."""
    from kvprefetch.controlplane.cli import build_parser

    out: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    out[f"{prefix} {choice.dest}"] = choice.help or ""
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}")

    walk(build_parser(), "kvprefetch")
    return out


# --------------------------------------------------------------------------- configuration


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the ``#:`` comment lines above it (or its trailing ``#`` comment), from
    the source of ``cls`` and its bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "typing") or klass.__module__.startswith("pydantic"):
            continue
        try:
            source, _ = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        body_indent: int | None = None
        pending: list[str] = []
        for raw in source[1:]:
            stripped = raw.strip()
            if not stripped:
                pending = []
                continue
            indent = len(raw) - len(raw.lstrip())
            if body_indent is None:
                body_indent = indent
            if indent != body_indent:
                continue  # continuation lines, method bodies
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
                continue
            match = re.match(r"([A-Za-z_]\w*)\s*:[^=]", stripped + " ")
            if match:
                name = match.group(1)
                trailing = ""
                if "  # " in stripped:
                    trailing = stripped.split("  # ", 1)[1]
                text = " ".join(pending) or trailing
                if text:
                    out[name] = text
            pending = []
    return out


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _models_in(annotation: Any) -> list[type]:
    from pydantic import BaseModel

    found: list[type] = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _default(field: Any) -> str:
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if field.is_required():
        return "required"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    if hasattr(value, "value") and type(value).__module__ != "builtins":
        value = value.value  # enums by their config spelling
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _constraints(field: Any) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="),
                           ("min_length", "min length"), ("max_length", "max length"),
                           ("pattern", "pattern")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} `{value}`")
    return ", ".join(parts)


def _model_section(model: type, title: str, documented: dict[type, str],
                   queue: list[tuple[type, str]]) -> list[str]:
    comments = _field_comments(model)
    # Only a docstring of the model's own (inspect.getdoc would inherit BaseModel's).
    doc = inspect.cleandoc(model.__dict__.get("__doc__") or "")
    lines = [f"### {title} {{ #{documented[model]} }}", ""]
    lines.append(f"`{model.__module__}.{model.__qualname__}`")
    lines.append("")
    if doc:
        lines += [_plain(doc), ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        type_text = _cell(_type_name(annotation))
        links = []
        for sub in _models_in(annotation):
            if sub not in documented:
                documented[sub] = _anchor(f"{title}-{name}")
                queue.append((sub, f"{title}.{name}"))
            links.append(f"[{sub.__name__}](#{documented[sub]})")
        if len(links) == 1 and type_text == _cell(_models_in(annotation)[0].__name__):
            type_text = links[0]
        elif links:
            type_text += " (" + ", ".join(links) + ")"
        description = field.description or comments.get(name, "")
        limits = _constraints(field)
        if limits:
            description = f"{description} ({limits})" if description else f"({limits})"
        lines.append(f"| `{name}` | {type_text} | `{_cell(_default(field))}` | "
                     f"{_cell(description)} |")
    lines.append("")
    return lines


def config_models() -> list[tuple[str, str, type]]:
    """(heading, prose, model) for each root the configuration page documents."""
    from kvprefetch.controlplane.base.config import FleetConfig
    from kvprefetch.controlplane.cli.serve_config import ServeConfig
    from kvprefetch.controlplane.live.config import ServiceConfig

    return [
        ("serve", "The file `kvprefetch serve --config FILE` reads (YAML; `kvprefetch init DIR` "
         "writes an example). Its `fleet` and `service` sections are the two models below.",
         ServeConfig),
        ("service", "The scheduler: the `service:` section of the serve config, and the "
         "scheduler the demo and the benchmarks start.", ServiceConfig),
        ("fleet", "The modelled fleet: the `fleet:` section of the serve config, and "
         "`kvprefetch sim --fleet FILE` (the serve config sets the number of nodes from the "
         "cluster).", FleetConfig),
    ]


def config_page() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated at build time from the pydantic models: every field with its type, "
        "default, limits and the comment that documents it in the source. Every model "
        "refuses unknown keys (`extra=\"forbid\"`) and is validated at start-up; units are "
        "in the field names (`_s` seconds, `_bytes` bytes, `_gbps` gigabits per second).",
        "",
    ]
    documented: dict[type, str] = {}
    for title, prose, root in config_models():
        lines += [f"## {title}: `{root.__name__}`", "", prose, ""]
        documented[root] = _anchor(title)
        queue: list[tuple[type, str]] = [(root, title)]
        while queue:
            model, path = queue.pop(0)
            lines += _model_section(model, path, documented, queue)
    return "\n".join(lines)


# --------------------------------------------------------------------------- HTTP API


def openapi_document() -> dict[str, Any]:
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.http_api import create_app

    # An HTTP client does no I/O until called: enough to build the app and its schema.
    app = create_app(connect("http://127.0.0.1:9"), bearer_token="reference")
    return app.openapi()


def _schema_type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor('schema-' + name)})"
    if "anyOf" in schema:
        return " \\| ".join(_schema_type(s) for s in schema["anyOf"])
    if "oneOf" in schema:
        return " \\| ".join(_schema_type(s) for s in schema["oneOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_schema_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        if isinstance(extra, dict):
            return f"object of {_schema_type(extra)}"
    return str(kind)


_LIMITS = (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
           ("exclusiveMaximum", "<"), ("minLength", "min length"), ("maxLength", "max length"),
           ("minItems", "min items"), ("maxItems", "max items"), ("pattern", "pattern"))


def _schema_limits(schema: dict[str, Any]) -> str:
    parts = [f"{sign} `{schema[key]}`" for key, sign in _LIMITS if key in schema]
    for sub in schema.get("anyOf", []):
        parts += [f"{sign} `{sub[key]}`" for key, sign in _LIMITS if key in sub]
    return ", ".join(parts)


def http_page() -> str:
    doc = openapi_document()
    info = doc.get("info", {})
    lines = [
        "# HTTP API reference",
        "",
        "Generated at build time from the OpenAPI document of the app `kvprefetch serve` runs "
        "(`kvprefetch.controlplane.live.http_api.create_app`); a running service serves the "
        "same at `/openapi.json` and an interactive page at `/docs`.",
        "",
        f"**{info.get('title', '')}** {info.get('version', '')}: "
        f"{_cell(info.get('description', ''))}",
        "",
        "| method | path | summary |",
        "|---|---|---|",
    ]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            anchor = _anchor(f"{method} {path}")
            lines.append(f"| {method.upper()} | [`{path}`](#{anchor}) | "
                         f"{_cell(op.get('summary', ''))} |")
    lines += ["", "## Paths", ""]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            anchor = _anchor(f"{method} {path}")
            lines += [f"### {method.upper()} `{path}` {{ #{anchor} }}", ""]
            if op.get("description"):
                lines += [op["description"], ""]
            if op.get("security"):
                schemes = ", ".join(k for s in op["security"] for k in s)
                lines += [f"Authentication: {schemes} (`Authorization: Bearer <token>`).", ""]
            body = op.get("requestBody")
            if body:
                for media, content in body.get("content", {}).items():
                    lines += [f"Request body ({media}): {_schema_type(content.get('schema', {}))}",
                              ""]
            lines += ["| status | description | body |", "|---|---|---|"]
            for status, response in sorted(op.get("responses", {}).items()):
                content = response.get("content", {})
                shape = ", ".join(_schema_type(c.get("schema", {})) for c in content.values()
                                  if c.get("schema"))
                lines.append(f"| {status} | {_cell(response.get('description', ''))} | "
                             f"{shape} |")
            lines.append("")
    lines += ["## Schemas", ""]
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        lines += [f"### {name} {{ #{_anchor('schema-' + name)} }}", ""]
        if schema.get("description"):
            lines += [_cell(schema["description"]), ""]
        props = schema.get("properties", {})
        if not props:
            lines += [f"Type: {_schema_type(schema)}", ""]
            continue
        required = set(schema.get("required", []))
        lines += ["| field | type | required | default | description |",
                  "|---|---|---|---|---|"]
        for prop, sub in props.items():
            default = f"`{json.dumps(sub['default'])}`" if "default" in sub else ""
            description = sub.get("description", "")
            limits = _schema_limits(sub)
            if limits:
                description = f"{description} ({limits})" if description else f"({limits})"
            lines.append(f"| `{prop}` | {_schema_type(sub)} | "
                         f"{'yes' if prop in required else ''} | {default} | "
                         f"{_cell(description)} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- metrics


def _registry_metrics(registry: Any) -> list[tuple[str, str, str, str]]:
    """(exposed name, type, labels, help) of each metric a registry holds now."""
    rows = []
    collectors = getattr(registry, "_collector_to_names", {})
    labels_of: dict[str, str] = {}
    for collector in collectors:
        names = getattr(collector, "_labelnames", ())
        base = getattr(collector, "_name", None)
        if base:
            labels_of[base] = ", ".join(names)
    for family in registry.collect():
        exposed = family.name + ("_total" if family.type == "counter" else "")
        rows.append((exposed, family.type, labels_of.get(family.name, ""), family.documentation))
    return rows


def metrics_page() -> str:
    from kvprefetch.controlplane.live.gateway_metrics import GatewayMetrics
    from kvprefetch.controlplane.live.http_api import _HttpMetrics
    from kvprefetch.controlplane.live.metrics import PrometheusMetrics

    lines = [
        "# Metrics reference",
        "",
        "Generated at build time from the Prometheus registries of the scheduler service and "
        "the gateway (`kvprefetch.controlplane.live.metrics`, "
        "`kvprefetch.controlplane.live.http_api`, "
        "`kvprefetch.controlplane.live.gateway_metrics`). Counters are exposed with the "
        "`_total` suffix, histograms as `_bucket`, `_sum` and `_count`.",
        "",
    ]
    sources: list[tuple[str, str, Any, str]] = [
        ("Scheduler service", "the service's `/metrics` (the HTTP API of `kvprefetch serve`)",
         PrometheusMetrics().registry,
         str(ROOT / "controlplane" / "live" / "metrics.py")),
        ("HTTP API", "the service's `/metrics` too, per call of its HTTP API",
         _HttpMetrics().registry,
         str(ROOT / "controlplane" / "live" / "http_api.py")),
        ("Gateway", "the gateway's `/metrics` (`kvprefetch gateway`)",
         GatewayMetrics("reference").registry,
         str(ROOT / "controlplane" / "live" / "gateway_metrics.py")),
    ]
    for title, where, registry, source in sources:
        rows = _registry_metrics(registry)
        lines += [f"## {title}", "", f"Served at {where}.", "",
                  "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for name, kind, labels, helptext in rows:
            lines.append(f"| `{name}` | {kind} | {labels} | {_cell(helptext)} |")
        listed = {r[0].removesuffix("_total") for r in rows}
        more = sorted(set(re.findall(r'"(kvprefetch_[a-z0-9_]+)"', Path(source).read_text()))
                      - listed)
        if more:
            lines += ["", "Exported once the service has state to report (agents, orders, "
                      "tenants): " + ", ".join(f"`{m}`" for m in more) + "."]
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- snippets


def _policies_table() -> str:
    from kvprefetch.controlplane.core.policies import POLICIES, POLICY_NAMES

    lines = ["| policy | local DRAM tier | remote store | remote load starts | eviction | "
             "prefetch | modelled on |", "|---|---|---|---|---|---|---|"]
    for name, spec in POLICIES.items():
        shown = f"`{name}`" + ("" if name in POLICY_NAMES else " (by name only)")
        lines.append(
            f"| {shown} | {'yes' if spec.dram_tier else 'no'} | "
            f"{'yes' if spec.remote else 'no'} | {spec.load_start.value} | "
            f"{spec.eviction.value}{', suffix' if spec.suffix_eviction else ''} | "
            f"{'yes' if spec.prefetch else 'no'}{' (waste budget)' if spec.waste_budget else ''}"
            f" | {_cell(spec.modelled_on)} |")
    return "\n".join(lines)


def _load_start_table() -> str:
    from kvprefetch.controlplane.core.policies import EvictionKind, LoadStart

    lines = ["| value | meaning |", "|---|---|"]
    for enum_cls in (LoadStart, EvictionKind):
        comments = _enum_comments(enum_cls)
        for member in enum_cls:
            lines.append(f"| `{member.value}` ({enum_cls.__name__}) | "
                         f"{_cell(comments.get(member.name, ''))} |")
    return "\n".join(lines)


def _enum_comments(cls: type) -> dict[str, str]:
    source, _ = inspect.getsourcelines(cls)
    out: dict[str, str] = {}
    pending: list[str] = []
    for raw in source[1:]:
        stripped = raw.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"([A-Z_]+)\s*=", stripped)
        if match:
            trailing = stripped.split("  # ", 1)[1] if "  # " in stripped else ""
            out[match.group(1)] = " ".join(pending) or trailing
        pending = []
    return out


def _stop_reasons_table() -> str:
    from kvprefetch.controlplane.base.vocabulary import STOP_REASON_ALIASES, STOP_REASONS

    lines = ["| canonical | accepted as |", "|---|---|"]
    for reason in STOP_REASONS:
        aliases = [a for a, c in STOP_REASON_ALIASES.items() if c == reason]
        lines.append(f"| `{reason}` | {', '.join(f'`{a}`' for a in aliases)} |")
    return "\n".join(lines)


def _hint_kinds() -> str:
    from kvprefetch.controlplane.base.vocabulary import HINT_KINDS

    return ", ".join(f"`{k}`" for k in HINT_KINDS)


def _predictors() -> str:
    from kvprefetch.predictors.registry import available

    return ", ".join(f"`{name}`" for name in available())


def _alerts_table() -> str:
    import yaml

    path = ROOT / "examples" / "prometheus-alerts.yaml"
    if not path.exists():
        return "*(examples/prometheus-alerts.yaml is not in this checkout.)*"
    rules = yaml.safe_load(path.read_text())
    lines = ["| group | alert | for | severity | summary |", "|---|---|---|---|---|"]
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            if "alert" not in rule:
                continue
            lines.append(f"| {group['name']} | `{rule['alert']}` | {rule.get('for', '')} | "
                         f"{rule.get('labels', {}).get('severity', '')} | "
                         f"{_cell(rule.get('annotations', {}).get('summary', ''))} |")
    return "\n".join(lines)


def _dashboard_panels() -> str:
    path = ROOT / "examples" / "grafana-dashboard.json"
    if not path.exists():
        return "*(examples/grafana-dashboard.json is not in this checkout.)*"
    board = json.loads(path.read_text())
    titles = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            if panel.get("type") != "row" and panel.get("title"):
                titles.append(panel["title"])
            walk(panel.get("panels", []))

    walk(board.get("panels", []))
    return f"**{board.get('title', 'dashboard')}**: " + ", ".join(f"{t}" for t in titles) + "."


def _first_comment(path: Path) -> str:
    """The first sentence-line of a file's leading comment or docstring."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    if path.suffix == ".json":
        return ""
    for raw in text.splitlines()[:12]:
        line = raw.strip().lstrip("#").strip().strip('"').strip()
        if not line or line.startswith("!") or line.startswith("-*-"):
            continue
        return line
    return ""


def _examples_table() -> str:
    """Every file under examples/ as the checkout holds it at build time."""
    base = ROOT / "examples"
    lines = ["| file | what it is |", "|---|---|"]
    for path in sorted(p for p in base.rglob("*") if p.is_file()):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        lines.append(f"| `{rel}` | {_cell(_first_comment(path))} |")
    return "\n".join(lines)


def _deploy_files() -> str:
    """What the checkout ships for deployments: ray_cluster.yaml and examples/deploy/."""
    base = ROOT / "examples" / "deploy"
    files = [ROOT / "ray_cluster.yaml"]
    if base.exists():
        files += sorted(p for p in base.rglob("*") if p.is_file())
    lines = ["| file | what it is |", "|---|---|"]
    for path in files:
        if path.exists():
            lines.append(f"| `{path.relative_to(ROOT).as_posix()}` | "
                         f"{_cell(_first_comment(path))} |")
    if not base.exists():
        lines += ["", "This checkout has no `examples/deploy/` folder; `kvprefetch init DIR` "
                  "writes the deployment files the installed package ships."]
    return "\n".join(lines)


def _step_contract() -> str:
    """The contract between the core and its drivers, from ``core/step.py`` and the core."""
    from kvprefetch.controlplane.core import step
    from kvprefetch.controlplane.core.scheduler import SchedulerCore

    doc = _plain(inspect.getdoc(step) or "")
    lines = [doc, "", "The core's event methods that return a `StepOutput`:", "",
             "| method | what it handles |", "|---|---|"]
    for name, member in inspect.getmembers(SchedulerCore, inspect.isfunction):
        if name.startswith("_"):
            continue
        returns = member.__annotations__.get("return")
        if returns not in ("StepOutput", step.StepOutput):
            continue
        summary = (inspect.getdoc(member) or "").split("\n\n")[0]
        lines.append(f"| `{name}` | {_cell(summary)} |")
    lines += ["", "`StepOutput` fields:", "", "| field | type | default |", "|---|---|---|"]
    import dataclasses

    for field in dataclasses.fields(step.StepOutput):
        default = field.default if field.default is not dataclasses.MISSING else ""
        lines.append(f"| `{field.name}` | {_cell(str(field.type))} | `{default!r}` |")
    return "\n".join(lines)


SNIPPETS: dict[str, Callable[[], str]] = {
    "step-contract": _step_contract,
    "examples": _examples_table,
    "deploy-files": _deploy_files,
    "policies": _policies_table,
    "load-start": _load_start_table,
    "stop-reasons": _stop_reasons_table,
    "hint-kinds": _hint_kinds,
    "predictors": _predictors,
    "alerts": _alerts_table,
    "dashboard": _dashboard_panels,
}

GENERATED_PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/configuration.md": config_page,
    "reference/http-api.md": http_page,
    "reference/metrics.md": metrics_page,
}


def _results_module() -> Any:
    spec = importlib.util.spec_from_file_location("_kvp_results_generate",
                                                  DOCS / "results" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- MkDocs events


def on_files(files: Files, config: Any) -> Files:
    for uri, render in GENERATED_PAGES.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=render()))
    return files


_SNIPPET = re.compile(r"<!-- gen:([a-z-]+) -->")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in SNIPPETS:
            raise KeyError(f"{page.file.src_uri}: unknown generated snippet {name!r}")
        return SNIPPETS[name]()

    markdown = _SNIPPET.sub(fill, markdown)
    if "<!-- results:" in markdown:
        markdown = _results_module().fill(markdown)
    return markdown
