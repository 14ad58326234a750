"""The docs hold together: every protocol section the code cites exists in docs/protocol.md, every
relative link in the README and docs/ points at a file (and heading) that exists, the README's
Python blocks parse, docs/performance.md's contents list its sections, and what the README and
docs/ name (constructor arguments and defaults, epd-transfer options, make targets, exceptions,
metric series and metrics calls, pool counts, modules, `EPD_*` variables, keywords passed to the
public API) exists."""

from __future__ import annotations

import ast
import glob
import math
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = [os.path.join(REPO, "README.md"), os.path.join(REPO, "CHANGELOG.md"),
        *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
SOURCES = [path for pattern in ("transfer/**/*.py", "native/*.[ch]", "scripts/*")
           for path in glob.glob(os.path.join(REPO, pattern), recursive=True)]

# "SPEC.md section 9", "SPEC.md sections 5, 7 and 8", "SPEC.md 4.2", "SPEC.md 2-4, 6, 8", "SPEC 6".
_CITATION = re.compile(r"SPEC(?:\.md)?(?:'s)?\s+(?:sections?\s+)?"
                       r"((?:\d+(?:\.\d+)?(?![\d.]|\s*parts)(?:\s*(?:,|and|-|/|\+)\s*)?)+)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _sections() -> set[str]:
    headings = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", _read(os.path.join(REPO, "docs", "protocol.md")), re.M)
    return set(headings)


def _cited(text: str) -> set[str]:
    cited = set()
    for match in _CITATION.finditer(text):
        numbers = re.findall(r"\d+(?:\.\d+)?", match.group(1))
        cited.update(numbers)
        for low, high in re.findall(r"(\d+)\s*-\s*(\d+)", match.group(1)):
            cited.update(str(n) for n in range(int(low), int(high) + 1))
    return cited


def test_the_citation_pattern_reads_every_form():
    assert _cited("SPEC.md sections 5, 7 and 8; SPEC.md 4.2, 13 parts; SPEC.md 2-4, 6; SPEC 9's text") == \
        {"2", "3", "4", "4.2", "5", "6", "7", "8", "9"}


def test_every_cited_protocol_section_exists():
    sections = _sections()
    assert {"1", "2", "3", "4", "4.1", "4.2", "4.3", "5", "6", "7", "8", "9"} <= sections
    missing = {}
    for path in SOURCES + DOCS:
        unknown = _cited(_read(path)) - sections
        if unknown:
            missing[os.path.relpath(path, REPO)] = sorted(unknown)
    assert not missing, f"cited sections with no heading in docs/protocol.md: {missing}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: os.path.relpath(p, REPO))
def test_relative_links_resolve(path):
    text = _read(path)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        assert os.path.exists(resolved), f"{os.path.relpath(path, REPO)} links to missing {target}"
        if anchor and resolved.endswith(".md"):
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", _read(resolved), re.M)}
            assert anchor in anchors, f"{os.path.relpath(path, REPO)} links to missing heading {target}"


def test_the_readme_python_blocks_parse():
    blocks = re.findall(r"```python\n(.*?)```", _read(os.path.join(REPO, "README.md")), re.S)
    assert len(blocks) >= 2
    for block in blocks:
        ast.parse(block)


def test_the_readme_keeps_the_two_commands():
    readme = _read(os.path.join(REPO, "README.md"))
    assert "make test" in readme and "make demo" in readme


def _contents(text: str) -> list[tuple[str, str]]:
    """(title, anchor) of each line of the list that follows a file's "Contents:" line."""
    block = text.split("\nContents:\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    return re.findall(r"^- \[([^\]]+)\]\(#([^)]+)\)", block, re.M)


def test_the_contents_reader_reads_the_list_after_its_line():
    text = "# T\n\nContents:\n\n- [A b](#a-b): one\n- [C](#c)\n\n- [D](#d)\n\n## A b\n"
    assert _contents(text) == [("A b", "a-b"), ("C", "c")]


def test_the_performance_contents_list_every_section_in_order():
    text = _read(os.path.join(REPO, "docs", "performance.md"))
    sections = re.findall(r"^## (.+)$", text, re.M)
    listed = _contents(text)
    assert [title for title, _ in listed] == sections
    assert [anchor for _, anchor in listed] == [_anchor(title) for title in sections]


_GUARANTEES = os.path.join(REPO, "docs", "guarantees.md")


def _cited_tests(text: str) -> list[tuple[str, str]]:
    """(file, test name) of every `tests/...py::test_name` the text cites."""
    return re.findall(r"`(tests/(?:unit|live)/[\w/]+\.py)::(\w+)`", text)


def test_every_test_the_guarantees_cite_exists():
    cited = _cited_tests(_read(_GUARANTEES))
    assert len(cited) > 100
    missing = []
    for path, name in cited:
        file = os.path.join(REPO, path)
        if not os.path.exists(file) or not re.search(rf"^(?:async )?def {name}\(", _read(file), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"


def test_every_guarantee_names_the_tests_that_show_it():
    text = _read(_GUARANTEES)
    promises, _, mapping = text.partition("\n## Which tests show each guarantee\n")
    titles = [title.rstrip(".") for title in re.findall(r"^- \*\*(.+?)\*\*", promises, re.M)]
    assert len(titles) >= 11
    sections = dict(re.findall(r"^### (.+)\n\n((?:- .*\n?)+)", mapping, re.M))
    for title in titles:
        assert title in sections, f"guarantee {title!r} has no section under 'Which tests show each guarantee'"
        assert _cited_tests(sections[title]), f"guarantee {title!r} names no test"


def test_no_guarantee_lists_the_same_part_twice():
    # "- A prefill room's deadline, naming its encode rank: `tests/...`": one line per part of a guarantee.
    mapping = _read(_GUARANTEES).partition("\n## Which tests show each guarantee\n")[2]
    for title, lines in re.findall(r"^### (.+)\n\n((?:- .*\n?)+)", mapping, re.M):
        parts = [line.partition(": `")[0] for line in lines.splitlines()]
        repeated = sorted({part for part in parts if parts.count(part) > 1})
        assert not repeated, f"docs/guarantees.md lists these parts of {title!r} twice: {repeated}"


@pytest.mark.parametrize("path", ["README.md", os.path.join("docs", "architecture.md")])
def test_the_failure_kinds_listed_are_the_ones_there_are(path):
    from transfer.core.failure import FailureKind

    text = " ".join(_read(os.path.join(REPO, path)).split())
    listed = re.search(r"\((?:`transfer\.core\.failure\.FailureKind`: )?(deadline, [a-z_, ]+)\)", text)
    assert listed is not None, f"{path} lists no failure kinds"
    assert listed.group(1).split(", ") == [kind.value for kind in FailureKind]


def test_the_readme_layout_names_every_core_module():
    # The Layout block's `core/` entry: the cores, failure.py, bounded.py and "one module per policy (...)".
    layout = _read(os.path.join(REPO, "README.md")).partition("\n## Layout\n")[2].partition("\n## ")[0]
    entry = layout.partition("  core/")[2].partition("\n  drive/")[0]
    named = set(re.findall(r"\b(\w+)\.py\b", entry))
    named |= set(re.search(r"one module per policy \(([^)]*)\)", entry, re.S).group(1).replace(",", " ").split())
    modules = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "transfer", "core", "*.py"))} - {"__init__"}
    assert modules - named == set(), f"README's Layout leaves out transfer/core modules: {sorted(modules - named)}"
    assert named - modules == set(), f"README's Layout names core modules that do not exist: {sorted(named - modules)}"
    public = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "transfer", "[!_]*.py"))}
    listed = set(re.findall(r"\b(\w+)\.py\b", layout.partition("\ntransfer/\n")[2].partition("\n  core/")[0]))
    listed |= set(re.findall(r"\b(\w+)\.py\b", layout.partition("\n  drive/")[2].partition("\ntests/")[0]))
    assert public - listed == set(), f"README's Layout leaves out transfer/ modules: {sorted(public - listed)}"


def _configuration_rows() -> list[tuple[str, list[str], str]]:
    """(where, arguments, default) of each row of the README's constructor-argument table."""
    text = _read(os.path.join(REPO, "README.md")).partition("\n## Configuration\n")[2].partition("\n## ")[0]
    table = text.partition("| where | argument |")[2].partition("\n\n")[0]
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append((cells[0], re.findall(r"`(\w+)`", cells[1]), cells[2]))
    return rows


def test_every_argument_in_the_readme_configuration_table_is_one_the_component_takes():
    import inspect

    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.buffers import ReceivePool
    from transfer.engine import Engine
    from transfer.receiver import SessionManager
    from transfer.sender import SenderPool
    from transfer.wire_engine import WireEngine

    callables = {"Engine": Engine, "WireEngine": WireEngine, "SessionManager": SessionManager,
                 "SenderPool": SenderPool, "ReceivePool": ReceivePool, "BootstrapServer": BootstrapServer,
                 "BootstrapClient": BootstrapClient, "BootstrapClient.register_rank": BootstrapClient.register_rank}
    rows = _configuration_rows()
    assert len(rows) >= 20
    for where, arguments, _ in rows:
        names = ["SessionManager", "SenderPool"] if where == "both" else re.findall(r"`([\w.]+)`", where)
        assert names and arguments, f"README Configuration row {where!r} names no component or argument"
        for name in names:
            assert name in callables, f"README Configuration row names {name!r}, not a component this test knows"
            taken = inspect.signature(callables[name]).parameters
            for argument in arguments:
                assert argument in taken, f"README Configuration: {name} takes no argument {argument!r}"


def test_the_readme_configuration_defaults_that_are_plain_values_are_the_signatures():
    import inspect

    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.engine import Engine
    from transfer.wire_engine import WireEngine

    def shown(value: object) -> str:
        if isinstance(value, float) and value.is_integer():
            return f"{int(value)} s"
        return str(value)

    callables = {"Engine": Engine, "WireEngine": WireEngine, "BootstrapServer": BootstrapServer,
                 "BootstrapClient": BootstrapClient}
    checked = 0
    for where, arguments, default in _configuration_rows():
        name = where.strip("`")
        if name not in callables:
            continue
        parameters = inspect.signature(callables[name]).parameters
        # "`127.0.0.1`, `auto`, every device, ..." or "30 s, 300 s, 10 s (...)": one default per argument.
        defaults = [d.strip().strip("`") for d in re.sub(r"\([^()]*\)", "", default).split(",")]
        for argument, documented in zip(arguments, defaults):
            if argument not in parameters:  # the test above names it
                continue
            value = parameters[argument].default
            if isinstance(value, (str, float)) and value != "" or type(value) is int and 0 < value < 1 << 16:
                assert documented == shown(value), (name, argument, documented, value)
                checked += 1
    assert checked >= 10


def _options() -> dict[str, set[str]]:
    """Each epd-transfer subcommand's options ("" for the top level's)."""
    import argparse

    from transfer.cli import build_parser

    parser = build_parser()
    options = {"": {o for action in parser._actions for o in action.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                options[name] = {o for act in sub._actions for o in act.option_strings}
    return options


def test_every_epd_transfer_option_the_docs_show_exists():
    # "`epd-transfer bench --stages`", "`rank --deadline`", "`demo --protocol wire`", "`bootstrap|rank --exit-with`"
    options = _options()
    every = set().union(*options.values()) | _script_options()
    wrong = []
    for path in [p for p in DOCS if not p.endswith("CHANGELOG.md")]:  # the changelog keeps past options
        text = _read(path)
        for span in re.findall(r"`([^`\n]+)`", text):
            shown = re.match(r"(?:\.venv/bin/)?(?:epd-transfer )?((?:demo|doctor|bench|bootstrap|rank)(?:\|\w+)*)((?: .*)?)$",
                             span)
            if shown and (span.startswith(("epd-transfer", ".venv")) or shown.group(2).lstrip().startswith("-")):
                subs = shown.group(1).split("|")
                for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][-\w]*)", shown.group(2)):
                    if not all(flag in options[sub] | options[""] for sub in subs):
                        wrong.append(f"{os.path.relpath(path, REPO)}: {span}")
        for flag in re.findall(r"`(--[a-z][-a-z0-9]*)[ `=]", text):
            if flag not in every and flag not in _read(os.path.join(REPO, "scripts", "zmq-floor.sh")):
                wrong.append(f"{os.path.relpath(path, REPO)}: {flag}")
        for sub in re.findall(r"epd-transfer (\w[-\w]*)", text):
            if sub not in options:
                wrong.append(f"{os.path.relpath(path, REPO)}: epd-transfer {sub}")
    assert not wrong, f"the docs show epd-transfer options that do not exist: {wrong}"


def _script_options() -> set[str]:
    """The long options scripts/*.py define (`add_argument("--...")`), which the docs may show beside the CLI's."""
    return {flag for path in glob.glob(os.path.join(REPO, "scripts", "*.py"))
            for flag in re.findall(r"add_argument\(\s*\"(--[a-z][-a-z0-9]*)\"", _read(path))}


def test_the_scripts_options_are_read_from_their_parsers():
    flags = _script_options()
    assert {"--aa", "--runs", "--keep", "--start-timeout", "--rooms"} <= flags
    assert "--made-up-flag" not in flags


def test_every_make_target_the_docs_show_exists():
    targets = set(re.search(r"^\.PHONY: (.*)$", _read(os.path.join(REPO, "Makefile")), re.M).group(1).split())
    for path in DOCS:
        for target in re.findall(r"`make ([a-z][-a-z]*)", _read(path)):
            assert target in targets, f"{os.path.relpath(path, REPO)} shows `make {target}`, which the Makefile lacks"


def test_the_readme_errors_section_names_every_exception_with_its_bases():
    import transfer.errors
    import transfer.wire

    text = " ".join(_read(os.path.join(REPO, "README.md")).partition("\n## Errors\n")[2].partition("\n## ")[0].split())
    exceptions = {name: getattr(transfer.errors, name) for name in dir(transfer.errors)
                  if isinstance(getattr(transfer.errors, name), type) and issubclass(getattr(transfer.errors, name),
                                                                                    BaseException)}
    exceptions.update({f"transfer.wire.{name}": getattr(transfer.wire, name)
                       for name in ("FrameError", "MsgError", "LayerError")})
    for name, cls in exceptions.items():
        short = name.rpartition(".")[2]
        assert {f"`{name}`", f"`{short}`", f"`transfer.{short}`"} & set(re.findall(r"`[\w.]+`", text)), \
            f"README's Errors section does not name {name}"
        assert issubclass(cls, transfer.errors.TransferError), name
    # "`ConfigError` (a `ValueError`: ...", "`PortsInUse` (an `OSError`: ...", "its `CollectiveError`"
    claims = re.findall(r"`([\w.]+)` \(an? `(\w+)`", text)
    assert len(claims) >= 6
    builtins = __import__("builtins")
    for name, base in claims:
        cls = exceptions.get(name) or exceptions[name.rpartition(".")[2]]
        assert issubclass(cls, getattr(builtins, base)), f"README says {name} is a {base}; it is not"
    assert issubclass(exceptions["CollectiveError"], exceptions["UsageError"])
    for kind, parent in (("BootstrapUnreachable", "BootstrapError"), ("BootstrapNoRoute", "BootstrapError"),
                         ("EngineUnavailable", "EngineError")):
        assert issubclass(exceptions[kind], exceptions[parent]), (kind, parent)


def _table_after(path: str, heading: str) -> list[list[str]]:
    """The cells of the first table after `heading` in `path`."""
    text = _read(os.path.join(REPO, path)).partition(heading)[2]
    table = re.search(r"^\|.*\|\n\|[-| ]+\|\n((?:\|.*\|\n?)+)", text, re.M).group(1)
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]


def test_the_operations_metrics_table_lists_the_series_there_are():
    from transfer.metrics import KNOWN_HELP, ROLE_COUNTERS

    documented = {}
    for names, kind, side, _ in _table_after("docs/operations.md", "and `_count`."):
        listed = re.findall(r"`(\w+?)(?:\{\w+\})?`", names)
        sides = [s.strip() for s in side.split("/")]
        for index, name in enumerate(listed):
            documented[name] = (kind, sides[index] if len(sides) == len(listed) else side)
    assert set(documented) == set(KNOWN_HELP), "docs/operations.md's series table and transfer.metrics.KNOWN_HELP differ"
    for name, (kind, side) in documented.items():
        roles = [role for role in ("encode", "prefill") if name in ROLE_COUNTERS[role]]
        if kind == "counter":
            assert roles == ({"both": ["encode", "prefill"]}.get(side) or [side]), (name, side, roles)
        else:
            assert not roles, (name, kind)


def test_the_operations_pool_counts_table_lists_the_fields_there_are():
    from transfer.buffers import PoolStats

    fields = {re.search(r"`(\w+)`", row[0]).group(1) for row in _table_after("docs/operations.md", "### Receive pool counts")}
    assert fields == set(PoolStats.__annotations__)


def test_every_metrics_call_the_docs_show_exists():
    # "`transfer.metrics.serve(...)`" and a bare "`metrics.total(...)`" name the module;
    # "`manager.metrics.serve(host, port)`", "`pool.metrics.prometheus_text()`" a component's Metrics.
    import transfer.metrics
    from transfer.metrics import Metrics

    wrong, checked = [], 0
    for path in [p for p in DOCS if not p.endswith("CHANGELOG.md")]:  # the changelog keeps past names
        for owner, name in re.findall(r"`(transfer\.|\w+\.)?metrics\.(\w+)\(", _read(path)):
            where = transfer.metrics if owner in ("", "transfer.") else Metrics
            checked += 1
            if not hasattr(where, name):
                wrong.append(f"{os.path.relpath(path, REPO)}: {owner}metrics.{name}() "
                             f"({'transfer.metrics has' if where is transfer.metrics else 'Metrics has'} no {name})")
    assert checked >= 6
    assert not wrong, f"the docs call metrics functions that do not exist: {wrong}"


def test_every_metric_series_the_docs_name_exists():
    # "`epd_prefill_rooms_failed_total`", "`rooms_unverified_total`", "`cancels_total{reason}`",
    # "`epd_prefill_room_latency_seconds_bucket`": a series of transfer.metrics, namespaced or not.
    from transfer.buffers import PoolStats
    from transfer.metrics import KNOWN_HELP

    examples = {"a_b_c_total"}  # operations.md's example of two namespaces that overlap
    wrong, checked = [], 0
    for path in [p for p in DOCS if not p.endswith("CHANGELOG.md")]:
        text = _read(path)
        names = re.findall(r"`(epd_(?:prefill|encode)_\w+?|\w+_total|\w+_seconds)(?:\{\w+\})?`", text)
        names += re.findall(r'"name": "(epd_(?:prefill|encode)_\w+)"', text)
        for name in names:
            series = re.sub(r"^epd_(?:prefill|encode)_", "", name)
            series = re.sub(r"(_seconds)_(?:bucket|sum|count)$", r"\1", series)
            checked += 1
            if series not in KNOWN_HELP and series not in PoolStats.__annotations__ and name not in examples:
                wrong.append(f"{os.path.relpath(path, REPO)}: {name}")
    assert checked >= 20
    assert not wrong, f"the docs name metric series that transfer.metrics.KNOWN_HELP lacks: {wrong}"


def test_every_epd_variable_the_docs_name_is_read():
    # The library's (transfer.config.SETTINGS, the README's table) and the launch scripts' (launch.sh --help).
    from transfer import config, doctor

    read = {s.env for s in config.SETTINGS} | set(doctor.SCRIPT_VARIABLES)
    wrong = []
    for path in [p for p in DOCS if not p.endswith("CHANGELOG.md")]:
        for name in re.findall(r"\b(EPD_[A-Z][A-Z0-9_]*[A-Z0-9])\b", _read(path)):
            if name not in read:
                wrong.append(f"{os.path.relpath(path, REPO)}: {name}")
    assert not wrong, f"the docs name EPD_* variables that nothing reads: {wrong}"


def test_every_keyword_the_docs_pass_to_the_public_api_is_one_it_takes():
    # "`Engine(open_timeout_s=)`", "`ReceivePool(..., max_fallback_bytes=N)`", "`receive(..., deepstack_hidden=)`",
    # "`BootstrapClient(addr).wait_ready(timeout, encode_rank=)`": each keyword names a parameter.
    import inspect

    from transfer.bootstrap import BootstrapClient, BootstrapServer
    from transfer.buffers import ReceivePool
    from transfer.engine import Engine
    from transfer.frames import prefill_shard
    from transfer.metrics import Metrics, serve
    from transfer.reassemble import ShardedItem, agree, reassemble
    from transfer.receiver import ReceiveHandle, SessionManager
    from transfer.sender import SenderPool
    from transfer.wire_engine import WireEngine

    callables = {"Engine": Engine, "WireEngine": WireEngine, "SessionManager": SessionManager, "SenderPool": SenderPool,
                 "ReceivePool": ReceivePool, "BootstrapServer": BootstrapServer, "BootstrapClient": BootstrapClient,
                 "ShardedItem": ShardedItem, "reassemble": reassemble, "agree": agree, "Metrics": Metrics,
                 "serve": serve, "receive": SessionManager.receive, "send": SenderPool.send,
                 "register_rank": BootstrapClient.register_rank, "wait_ready": BootstrapClient.wait_ready,
                 "prefill_shard": prefill_shard, "clear": ReceiveHandle.clear}
    wrong, checked = [], 0
    for path in [p for p in DOCS if not p.endswith("CHANGELOG.md")]:  # the changelog keeps past names
        for span in re.findall(r"`([^`]+)`", " ".join(_read(path).split())):
            for name, arguments in re.findall(r"(\w+)\(([^()]*)\)", span):
                if name not in callables:
                    continue
                taken = inspect.signature(callables[name]).parameters
                for keyword in re.findall(r"(?:^|,)\s*(\w+)=", arguments):
                    checked += 1
                    if keyword not in taken:
                        wrong.append(f"{os.path.relpath(path, REPO)}: {span} ({name} takes no {keyword}=)")
    assert checked >= 20
    assert not wrong, f"the docs pass keywords the API does not take: {wrong}"


def test_the_latency_buckets_the_docs_state_are_the_ones_there_are():
    # "buckets from 0.1 ms to 60 s", and the bounds listed one after another, then "and +Inf".
    from transfer.metrics import LATENCY_BUCKETS

    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    stated, wrong = 0, []
    for path in DOCS:
        if path.endswith("CHANGELOG.md"):  # what changed, not what is
            continue
        text = _read(path)
        for low, low_unit, high, high_unit in re.findall(r"buckets from ([\d.]+) ?(us|ms|s) to ([\d.]+) ?(us|ms|s)\b",
                                                         text):
            stated += 1
            bounds = (float(low) * units[low_unit], float(high) * units[high_unit])
            if not all(math.isclose(a, b) for a, b in zip(bounds, (LATENCY_BUCKETS[0], LATENCY_BUCKETS[-1]))):
                wrong.append(f"{os.path.relpath(path, REPO)}: buckets from {low} {low_unit} to {high} {high_unit}")
        for listed in re.findall(r"^((?:\d+(?:\.\d+)?, )+\d+(?:\.\d+)?)\nand \+Inf", text, re.M):
            stated += 1
            if tuple(float(b) for b in listed.split(", ")) != LATENCY_BUCKETS:
                wrong.append(f"{os.path.relpath(path, REPO)}: {listed}")
    assert stated >= 2, "the README and docs/operations.md no longer state the latency buckets this test reads"
    assert not wrong, f"the docs state latency buckets other than transfer.metrics.LATENCY_BUCKETS: {wrong}"
