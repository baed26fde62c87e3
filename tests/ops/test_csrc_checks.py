"""The CUDA sources' TORCH_CHECK messages carry strings only (CPU; reads the sources).

On the GPU host (torch 2.11, CUDA 13) a failing TORCH_CHECK whose message had a number in it segfaulted instead of
raising - session 5 in the GEMM, session 57 in AdamW's chunk switch - while messages of strings raised; such checks
use BERTACCEL_CHECK (csrc/check.h: the message formatted by snprintf, handed over as one C string). A number in a
TORCH_CHECK message only shows when the check fails, on a GPU, so this test keeps them out of the sources."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "src" / "bertaccel" / "ops" / "csrc"
# message arguments that are C strings: the op's name, an environment variable's value
STRING_NAMES = {"op", "env"}
STRING_LITERAL = re.compile(r'^"(?:[^"\\]|\\.)*"(?:\s*"(?:[^"\\]|\\.)*")*$')
TERNARY_OF_LITERALS = re.compile(r'^[^?]+\?\s*"(?:[^"\\]|\\.)*"\s*:\s*"(?:[^"\\]|\\.)*"$')


def _top_level_args(body: str) -> list[str]:
    args, cur, depth, in_str, i = [], "", 0, False, 0
    while i < len(body):
        c = body[i]
        if c == "\\" and in_str:
            cur += body[i:i + 2]
            i += 2
            continue
        if c == '"':
            in_str = not in_str
        elif not in_str:
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
            elif c == "," and depth == 0:
                args.append(cur.strip())
                cur, i = "", i + 1
                continue
        cur += c
        i += 1
    args.append(cur.strip())
    return args


def torch_check_messages(source: str) -> list[tuple[int, list[str]]]:
    """(line, message arguments) of every TORCH_CHECK(cond, message...) call in `source`."""
    out = []
    for m in re.finditer(r"\bTORCH_CHECK\(", source):
        i, depth = m.end(), 1
        j = i
        while depth:
            depth += {"(": 1, ")": -1}.get(source[j], 0)
            j += 1
        out.append((source.count("\n", 0, m.start()) + 1, _top_level_args(source[i:j - 1])[1:]))
    return out


def non_string_arguments(args: list[str]) -> list[str]:
    return [a for a in args if not (STRING_LITERAL.match(a) or a in STRING_NAMES or TERNARY_OF_LITERALS.match(a)
                                    or a.startswith("static_cast<const char*>"))]


def test_the_parser_sees_numbers():
    src = 'TORCH_CHECK(n > 0, "bertaccel x: ", op, " has ", n, " rows, ", ok ? "yes" : "no");\nTORCH_CHECK(a, "b" "c");'
    calls = torch_check_messages(src)
    assert [line for line, _ in calls] == [1, 2]
    assert non_string_arguments(calls[0][1]) == ["n"] and non_string_arguments(calls[1][1]) == []


def test_torch_check_messages_carry_strings_only():
    sources = sorted(p for p in CSRC.iterdir() if p.suffix in {".cu", ".cuh", ".h", ".cpp"})
    assert len(sources) > 20
    bad = [f"{p.name}:{line}: {non_string_arguments(args)}" for p in sources
           for line, args in torch_check_messages(p.read_text()) if non_string_arguments(args)]
    assert not bad, "TORCH_CHECK messages with non-string values (use BERTACCEL_CHECK, csrc/check.h):\n" + "\n".join(bad)
