"""Read Nsight Compute's source page (`--csv --page source --print-source sass`) and say where the warps wait.

    mpfa profile ncu-source FILE [FILE ...]      (plain or .gz)

Per profiled kernel the page has a `"Kernel Name","<name>"` row, a header row, then one row per SASS instruction:
its absolute address, its text, its warp-level executions and its warp-state samples, in all and per stall reason.

A loop runs from a backward branch's target to the branch (`BRA`, predicated or not, to a lower or equal address);
nested and overlapping loops merge into the outermost one, and the outermost loops holding at least HOT_SHARE % of
the kernel's samples are reported, the rest of the kernel as one line. A warp-specialised kernel thus shows each
role's loop apart, with the spin loops where a role waits on an mbarrier inside it. On H200 captures of a
warp-specialised prefill kernel and of the split-KV decode this partition is the one read by hand from runs of equal
`Instructions Executed`: the prefill's producer loop (rows 1439-1872) and consumer loop (2955-3366), the decode's
split-KV loop (1044-1689).

ncu gives some samples no stall-reason column (on the H200, part of those on QGMMA instructions); they count as
UNATTRIBUTED, so an instruction's reasons add up to its samples.

A scoreboard stall (short: shared memory, MUFU, shuffles; long: global / local memory) waits for the result of a
variable-latency instruction. Each loop's such samples are charged to the opcode of the nearest earlier instruction
(in the loop, wrapping around its back edge) that writes one of the stalled instruction's source registers and has a
variable latency (`scoreboard_producers`): on an H100 capture of an fp8 prefill kernel, LDS.128 (the staged
Delta_S) before MUFU.EX2.
"""
from __future__ import annotations

import csv
import gzip
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..mpfa_cli.errors import ToolError
from .profile_sections import short_name
from .profile_result import NcuHotInstruction, NcuKernelLoops, NcuLoop
from .tools import parse_number

KERNEL_ROW = "Kernel Name"
ADDRESS, SASS, EXECUTED, SAMPLES = "Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"
STALL_PREFIX, NOT_ISSUED = "stall_", " (Not Issued)"
UNATTRIBUTED = "unattributed"
HOT_SHARE = 5.0  # % of the kernel's samples a loop needs to be reported
HOTTEST = 3  # instructions shown per loop
SASS_WIDTH = 40

SCOREBOARD_REASONS = ("short_sb", "long_sb")
# opcodes whose results arrive after a variable latency (their readers wait on a scoreboard)
VARIABLE_LATENCY = ("LDS", "LDSM", "LDG", "LDL", "LD", "LDC", "MUFU", "SHFL", "S2R", "ATOMS", "ATOM", "ATOMG",
                    "F2I", "I2F", "F2F", "POPC", "FLO", "BREV", "REDUX", "MATCH", "SYNCS")  # SYNCS: an mbarrier test
NO_DESTINATION = ("ST", "STS", "STG", "STL", "RED", "BAR", "BRA", "EXIT", "RET", "WARPGROUP", "FENCE")
UNKNOWN_PRODUCER = "other"  # no variable-latency writer of a source register: a register's reuse, a memory barrier
_REGISTER = re.compile(r"(?<![\w.])([RP]\d+)\b")  # R0 .. R255, P0 .. P6 (not UR, UP, RZ, PT or .reuse)
_PAIR = re.compile(r"(?<![\w.])R(\d+)\.64\b")  # a 64-bit register pair read as one operand (an address)
_WIDTH = re.compile(r"\.(64|128|X2|X4)\b|^LDSM\..*\.([24])$")  # a load's .64, .128, LDSM's .2 / .4
_REGISTERS_WRITTEN = {"64": 2, "128": 4, "X2": 2, "X4": 4, "2": 2, "4": 4}
# `BRA 0x7f08577ccb60`, `@!P0  BRA 0x...`, `BRA.U !UP0, 0x...`: the target is the last operand.
_BRANCH = re.compile(r"(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(?:[^,]+,\s*)*(0x[0-9a-f]+)\s*;?", re.IGNORECASE)


@dataclass(frozen=True)
class SourceInstruction:
    address: int
    sass: str
    executed: int  # warp-level executions
    samples: int  # warp-state samples taken at this instruction
    stalls: dict[str, int]  # reason (no `stall_` prefix) -> samples; zeros left out; adds up to `samples`


@dataclass(frozen=True)
class SourcePage:
    kernel: str
    instructions: list[SourceInstruction]


def parse_source_csv(text: str) -> list[SourcePage]:
    """One page per `"Kernel Name"` row; lines that are not CSV rows (==PROF==, ==WARNING==) are ignored."""
    pages: list[SourcePage] = []
    header: list[str] | None = None
    for row in csv.reader(line for line in text.splitlines() if line.startswith('"')):
        if row[0] == KERNEL_ROW:
            pages.append(SourcePage(row[1] if len(row) > 1 else "", []))
            header = None
        elif not pages:
            raise ToolError(f'not an ncu source page: it does not start with a "{KERNEL_ROW}" row')
        elif header is None:
            header = _checked_header(row)
        else:
            pages[-1].instructions.append(_instruction(dict(zip(header, row)), len(pages[-1].instructions)))
    if not pages:
        raise ToolError(f'not an ncu source page: no "{KERNEL_ROW}" row')
    for page in pages:
        if not page.instructions:
            raise ToolError(f"kernel {short_name(page.kernel)} has no instruction rows")
    return pages


def _checked_header(header: list[str]) -> list[str]:
    missing = [column for column in (ADDRESS, SASS, EXECUTED, SAMPLES) if column not in header]
    if not any(_is_reason(column) for column in header):
        missing.append(f"{STALL_PREFIX}* reasons")
    if missing:
        raise ToolError(f"not an ncu source page: the CSV header lacks {', '.join(map(repr, missing))}")
    return header


def _is_reason(column: str) -> bool:
    return column.startswith(STALL_PREFIX) and not column.endswith(NOT_ISSUED)


def _instruction(record: dict[str, str], row: int) -> SourceInstruction:
    try:
        address = int(record.get(ADDRESS, ""), 16)
    except ValueError:
        raise ToolError(f"instruction row {row}: address {record.get(ADDRESS)!r} is not hexadecimal") from None
    samples = _count(record.get(SAMPLES, ""))
    stalls = {column.removeprefix(STALL_PREFIX): count for column, text in record.items()
              if _is_reason(column) and (count := _count(text))}
    if (unattributed := samples - sum(stalls.values())) > 0:
        stalls[UNATTRIBUTED] = unattributed
    return SourceInstruction(address, " ".join(record.get(SASS, "").split()), _count(record.get(EXECUTED, "")),
                             samples, stalls)


def _count(text: str) -> int:
    """'1,536' -> 1536; '', '-' -> 0."""
    return int(parse_number(text) or 0)


def loop_spans(page: SourcePage) -> list[tuple[int, int]]:
    """(first row, last row) of each outermost loop, in address order."""
    rows = {instruction.address: row for row, instruction in enumerate(page.instructions)}
    spans = []
    for row, instruction in enumerate(page.instructions):
        if (branch := _BRANCH.fullmatch(instruction.sass)) and (target := int(branch[1], 16)) <= instruction.address:
            if target not in rows:
                raise ToolError(f"{short_name(page.kernel)}: {instruction.sass!r} at row {row} branches to "
                                f"{target:#x}, which is no instruction of the page")
            spans.append((rows[target], row))
    outermost: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if outermost and first <= outermost[-1][1]:
            outermost[-1] = (outermost[-1][0], max(outermost[-1][1], last))
        else:
            outermost.append((first, last))
    return outermost


def hot_loops(page: SourcePage) -> NcuKernelLoops:
    """The outermost loops holding at least HOT_SHARE % of the kernel's samples, and the rest of the kernel."""
    instructions = page.instructions
    total = sum(instruction.samples for instruction in instructions)
    hot = [(first, last) for first, last in loop_spans(page)
           if _percent(sum(i.samples for i in instructions[first:last + 1]), total) >= HOT_SHARE]
    in_loops = {row for first, last in hot for row in range(first, last + 1)}
    rest = [instruction for row, instruction in enumerate(instructions) if row not in in_loops]
    base = instructions[0].address
    loops = [_summary(instructions[first:last + 1], total, (first, last),
                      (instructions[first].address - base, instructions[last].address - base))
             for first, last in hot]
    return NcuKernelLoops(page.kernel, total, loops, _summary(rest, total, None, None))


def _summary(instructions: list[SourceInstruction], total: int, rows: tuple[int, int] | None,
             offsets: tuple[int, int] | None) -> NcuLoop:
    """A loop (`rows` given: executions are its first instruction's) or the rest of the kernel."""
    samples = sum(instruction.samples for instruction in instructions)
    stalls: Counter[str] = Counter()
    for instruction in instructions:
        stalls.update(instruction.stalls)
    hottest = sorted((i for i in instructions if i.samples), key=lambda i: i.samples, reverse=True)[:HOTTEST]
    producers = scoreboard_producers(instructions, wrap=rows is not None)
    return NcuLoop(rows, offsets, len(instructions), None if rows is None else instructions[0].executed,
                   _percent(samples, total),
                   [(reason, _percent(count, samples)) for reason, count in stalls.most_common()],
                   [NcuHotInstruction(_short_sass(i.sass), _percent(i.samples, samples),
                                      max(i.stalls, key=i.stalls.__getitem__)) for i in hottest],
                   [(opcode, _percent(count, samples)) for opcode, count in producers.most_common()])


def scoreboard_producers(instructions: list[SourceInstruction], wrap: bool = True) -> Counter[str]:
    """Each instruction's scoreboard-stall samples charged to the opcode (its first modifier kept) of the nearest
    earlier variable-latency writer of one of its source registers (``wrap``: a loop, searched back across its back
    edge), else to UNKNOWN_PRODUCER. A fixed-latency writer met first settles that register."""
    charged: Counter[str] = Counter()
    decoded = [_operands(instruction.sass) for instruction in instructions]
    for index, instruction in enumerate(instructions):
        if not (waiting := sum(instruction.stalls.get(reason, 0) for reason in SCOREBOARD_REASONS)):
            continue
        pending = set(decoded[index][2])
        earlier = range(index - 1, index - len(instructions), -1) if wrap else range(index - 1, -1, -1)
        producer = UNKNOWN_PRODUCER
        for row in earlier:
            opcode, written, _ = decoded[row]
            if not (hit := pending & written):
                continue
            if opcode.split(".")[0] in VARIABLE_LATENCY:
                producer = ".".join(opcode.split(".")[:2])  # LDS.128, MUFU.EX2, SYNCS.PHASECHK
                break
            pending -= hit
            if not pending:
                break
        charged[producer] += waiting
    return charged


def _operands(sass: str) -> tuple[str, set[str], set[str]]:
    """(opcode with its modifiers, registers written, registers read) of one SASS instruction: general registers
    R0 .. R255 and predicates P0 .. P6 (not RZ, PT or the uniform ones); the guard predicate is read."""
    guard, text = re.fullmatch(r"(?:@!?(U?P\w+)\s+)?(.*?)\s*;?", sass).groups()
    opcode, _, rest = text.partition(" ")
    operands = [operand.strip() for operand in rest.split(",")] if rest else []
    base = opcode.split(".")[0]
    leading = 0 if base in NO_DESTINATION or not operands else 2 if base == "SHFL" else 1  # SHFL: predicate, value
    if leading == 1 and len(operands) > 1 and re.fullmatch(r"P\d", operands[1]):
        leading = 2  # a carry or second predicate out (IADD3 R1, P0, ...; not ISETP's PT)
    written = {name for operand in operands[:leading] if "[" not in operand for name in _REGISTER.findall(operand)}
    size = (width := _WIDTH.search(opcode)) and (width[1] or width[2])
    if size and base in VARIABLE_LATENCY and (first := next((n for n in sorted(written) if n[0] == "R"), None)):
        written |= {f"R{int(first[1:]) + k}" for k in range(_REGISTERS_WRITTEN[size])}
    read = {name for index, operand in enumerate(operands) if index >= leading or "[" in operand
            for name in _REGISTER.findall(operand)}
    read |= {f"R{int(pair) + 1}" for operand in operands for pair in _PAIR.findall(operand)}  # R2.64: R2, R3
    return opcode, written, read | ({guard} if guard and re.fullmatch(r"P\d", guard) else set())


def _percent(part: int, whole: int) -> float:
    return 100 * part / whole if whole else 0.0


def _short_sass(sass: str) -> str:
    return sass if len(sass) <= SASS_WIDTH else sass[:SASS_WIDTH - 3] + "..."


def read_text(path: Path) -> str:
    """A file's text, gunzipped if its name ends in .gz."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as stream:
            return stream.read()
    return path.read_text(errors="replace")
