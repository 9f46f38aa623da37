"""What is live at the compiled peak, read from XLA's own buffer assignment.

The report's parts (parameters, gradients, optimizer state, saved activations, batch) are
what the paper's profiler counts. The compiled step holds more at its peak: the working set
of a block while it is recomputed and differentiated, the backend's float32 copies of 16-bit
work, the update's temporaries. XLA knows each of them: compiling with `xla_dump_to` writes
its buffer assignment, the live buffers at the peak of its heap simulation among them. This
module reads that dump and names every live buffer by where it comes from.
"""

import collections
import dataclasses
import glob
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from ..nn._jvp import RULE_SCOPE

# Parts of the live set at the peak, in the order they are printed.
PEAK_PARTS: tuple[str, ...] = (
    "parameters",
    "optimizer",
    "gradients",
    "activations",
    "recomputation",
    "backward",
    "upcasts",
    "update",
    "batch",
    "other",
)
PEAK_LABELS: dict[str, str] = {
    "parameters": "parameters (and model state)",
    "optimizer": "optimizer state",
    "gradients": "gradients and accumulator",
    "activations": "saved activations",
    "recomputation": "recomputed activations (remat working set)",
    "backward": "backward-pass temporaries",
    "upcasts": "backend float32 copies of 16-bit arrays",
    "update": "update temporaries",
    "batch": "batch",
    "other": "other temporaries",
}
# The options that make XLA write the optimized module as text and its buffer assignment
# with live ranges (`*_after_optimizations.txt`, `*-buffer-assignment.txt`,
# `*-live-range.txt`), each set rather than left to the jaxlib's defaults or to a user's
# XLA_FLAGS (the analysis option defaults to on in jaxlib 0.10 only by chance): every
# module dumped, as text, with the op names the parts are read from.
DUMP_OPTIONS = {
    "xla_dump_hlo_as_text": True,
    "xla_dump_buffer_assignment_analysis": True,
    "xla_dump_hlo_module_re": ".*",
    "xla_dump_disable_metadata": False,
}
# Compilations kept for reuse: a report and a plan (or two reports) of one step compile it
# once. Each holds a compiled executable: a few, not every candidate a plan tries.
_CACHE_SIZE = 8
_CACHE: collections.OrderedDict[tuple, tuple[Any, tuple[str, str, str] | None]] = (
    collections.OrderedDict()
)
# Compilations this process ran for `compile_with_peak` (what the cache saves: tests).
compile_count = 0

_LIVE = re.compile(r"^\s+(\S+?)\{([0-9,]*)\}: (\d+) bytes", re.M)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z][a-z0-9-]*)\((.*)$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%([^\s,}]+)")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_ELEMENT = re.compile(r"([a-z]+[0-9]*)\[")


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer live at the peak: its HLO value, bytes, dtype, part and op name."""

    value: str
    nbytes: int
    dtype: str
    part: str
    op_name: str


@dataclasses.dataclass(frozen=True)
class Peak:
    """The live set at the compiled peak.

    Attributes:
        buffers: every live buffer, largest first.
        live_bytes: their sum: the most bytes XLA holds at once.
    """

    buffers: tuple[PeakBuffer, ...]

    @property
    def live_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def parts(self) -> dict[str, int]:
        """Bytes per part, in the order of `PEAK_PARTS`."""
        out = dict.fromkeys(PEAK_PARTS, 0)
        for b in self.buffers:
            out[b.part] += b.nbytes
        return out


@dataclasses.dataclass(frozen=True)
class _Instruction:
    computation: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    op_name: str
    called: tuple[str, ...]  # computations it runs (a loop's body and condition, a call's)


class _Module:
    """An optimized HLO module's instructions, who uses them and who runs each computation."""

    def __init__(self, text: str):
        self.instructions: dict[str, _Instruction] = {}
        self.users: dict[str, list[str]] = {}
        self.caller: dict[str, str] = {}
        self.parameters: dict[int, str] = {}  # the entry computation's, by number
        self.entry = ""
        computation = ""
        for line in text.splitlines():
            header = _COMPUTATION.match(line)
            if header:
                computation = header.group(2)
                if header.group(1):
                    self.entry = computation
                continue
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, shape, opcode, rest = match.groups()
            operands = tuple(re.findall(r"%([^\s,()]+)", rest.split(")", 1)[0]))
            called = tuple(_CALLED.findall(rest))
            op = _OP_NAME.search(rest)
            self.instructions[name] = _Instruction(
                computation, opcode, shape, operands, op.group(1) if op else "", called
            )
            if opcode == "parameter" and computation == self.entry:
                self.parameters[int(rest.split(")", 1)[0])] = name
            for o in operands:
                self.users.setdefault(o, []).append(name)
            for c in called:
                self.caller.setdefault(c, name)


def read_peak(
    directory: str,
    argument_part: Callable[[str], str],
    *,
    sixteen_bit: bool = False,
    remove: bool = True,
) -> Peak | None:
    """The live set at the peak from the dump of one compilation in `directory` (then
    removed unless `remove=False`), or None where the dump is missing or in a form this
    reader does not know.

    Args:
        directory: where `xla_dump_to` wrote (one module).
        argument_part: the part of an entry parameter, from its op name (`"dynamic[3]"`,
            `"batch[0]"`, `"w"`: the names `jax.jit` gives the flattened arguments).
        sixteen_bit: the step computes in 16 bits, so a float32 result of a matrix
            product or convolution is the backend's (XLA:CPU computes them in float32).
    """
    dumps = _read_dumps(directory, remove=remove)
    if dumps is None:
        return None
    return _parse_peak(dumps, argument_part, sixteen_bit)


def _read_dumps(directory: str, *, remove: bool = True) -> tuple[str, str, str] | None:
    """The live ranges, optimized module and buffer assignment XLA dumped in `directory`."""
    texts = []
    try:
        for pattern in (
            "*_after_optimizations-live-range.txt",
            "*_after_optimizations.txt",
            "*_after_optimizations-buffer-assignment.txt",
        ):
            path = _only(directory, pattern)
            if path is None:
                return None
            with open(path) as f:
                texts.append(f.read())
    finally:
        if remove:
            shutil.rmtree(directory, ignore_errors=True)
    return texts[0], texts[1], texts[2]


def _parse_peak(
    dumps: tuple[str, str, str], argument_part: Callable[[str], str], sixteen_bit: bool
) -> Peak | None:
    text, module_text, assignment_text = dumps
    hlo = _Module(module_text)
    places, parameters = _allocations(assignment_text)
    head = text.find("(peak):")
    if head < 0:
        return None
    section = text[head : text.find("Stack trace", head)]
    parts = _Parts(hlo, argument_part, sixteen_bit)
    # Every argument's buffer is held for the whole step (the caller owns it), live or not;
    # then the live values, each counted once where values share an allocation's bytes.
    claimed: dict[int, list[tuple[int, int]]] = {}
    buffers = []

    def claim(value: str, name: str, index: str, nbytes: int) -> None:
        ins = hlo.instructions.get(name)
        dtype = _dtype(ins, index)
        where = places.get(value)
        if where is not None:
            allocation, offset, size = where
            nbytes = _unclaimed(claimed.setdefault(allocation, []), offset, size)
        if nbytes <= 0:
            return
        part = "upcasts" if dtype == "f32" and parts.upcast(name) else parts.of(name)
        buffers.append(PeakBuffer(value, nbytes, dtype, part, ins.op_name if ins else ""))

    for number, size in parameters.items():
        name = hlo.parameters.get(number)
        if name is not None:
            claim(f"{name}{{}}", name, "", size)
    for name, index, nbytes in sorted(_LIVE.findall(section), key=lambda v: -int(v[2])):
        claim(f"{name}{{{index}}}", name, index, int(nbytes))
    buffers.sort(key=lambda b: -b.nbytes)
    return Peak(tuple(buffers))


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(?:, parameter (\d+))?")
_VALUE = re.compile(
    r"^ value: <\d+ (\S+?)(\{[0-9,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)"
)


def _allocations(text: str) -> tuple[dict[str, tuple[int, int, int]], dict[int, int]]:
    """From XLA's buffer assignment: each value's `(allocation, offset, size)`, and the
    size of each entry parameter's allocation, by parameter number."""
    places: dict[str, tuple[int, int, int]] = {}
    parameters: dict[int, int] = {}
    allocation = -1
    for line in text.splitlines():
        head = _ALLOCATION.match(line)
        if head:
            allocation = int(head.group(1))
            if head.group(3) is not None:
                parameters[int(head.group(3))] = int(head.group(2))
            continue
        value = _VALUE.match(line)
        if value and allocation >= 0:
            key = f"{value.group(1)}{value.group(2) or '{}'}"
            places.setdefault(key, (allocation, int(value.group(4)), int(value.group(3))))
    return places, parameters


def _unclaimed(intervals: list[tuple[int, int]], offset: int, size: int) -> int:
    """Bytes of `[offset, offset + size)` not yet in `intervals` (then added to them)."""
    free = size
    for start, end in intervals:
        free -= max(0, min(end, offset + size) - max(start, offset))
    intervals.append((offset, offset + size))
    return max(free, 0)


def _only(directory: str, pattern: str) -> str | None:
    """The largest file matching `pattern` (the step's module; XLA may dump helpers too)."""
    paths = glob.glob(os.path.join(directory, pattern))
    return max(paths, key=os.path.getsize) if paths else None


def _dtype(ins: _Instruction | None, index: str) -> str:
    if ins is None:
        return ""
    types = _ELEMENT.findall(ins.shape)
    if not types:
        return ""
    if index and ins.shape.startswith("("):
        position = int(index.split(",")[0])
        return types[position] if position < len(types) else ""
    return types[0]


# Instructions that pass a value on (the same data, or a part of it).
_PASS = ("copy", "bitcast", "get-tuple-element", "tuple", "transpose", "reshape")
_SIXTEEN = ("f16", "bf16")


class _Parts:
    """Which part a buffer of the module belongs to, from where its value comes from."""

    def __init__(self, hlo: _Module, argument_part: Callable[[str], str], sixteen_bit: bool):
        self.hlo = hlo
        self.sixteen_bit = sixteen_bit
        self.argument_part = argument_part
        self.memo: dict[str, str] = {}

    def of(self, name: str, depth: int = 0) -> str:
        if name in self.memo:
            return self.memo[name]
        part = self._of(name, depth)
        self.memo[name] = part
        return part

    def _of(self, name: str, depth: int) -> str:
        ins = self.hlo.instructions.get(name)
        if ins is None or depth > 12:
            return "other"
        if ins.opcode == "parameter":
            if ins.computation == self.hlo.entry:
                return self.argument_part(ins.op_name)
            caller = self.hlo.caller.get(ins.computation)  # a loop's carry, a call's input
            return "other" if caller is None else self.of(caller, depth + 1)
        by_name = _by_op_name(ins)
        if by_name is not None:
            return by_name
        loop = self._loop_using(name)  # a loop's initial value (zeros it fills, a copy)
        if loop is not None:
            return self.of(loop, depth + 1)
        if ins.opcode in _PASS or ins.opcode == "fusion":
            # No op name of its own (a copy or layout change XLA made): its source's part.
            for o in ins.operands:
                if self.hlo.instructions.get(o, ins).opcode == "constant":
                    continue
                part = self.of(o, depth + 1)
                if part != "other":
                    return part
        return "other" if ins.op_name == "" else "update"

    def _loop_using(self, name: str) -> str | None:
        """The loop whose carry `name` starts (through tuples and copies), or None."""
        frontier = [name]
        for _ in range(3):
            users = [u for n in frontier for u in self.hlo.users.get(n, ())]
            for user in users:
                if self.hlo.instructions[user].opcode == "while":
                    return user
            frontier = [u for u in users if self.hlo.instructions[u].opcode in ("tuple", "copy")]
        return None

    def upcast(self, name: str, depth: int = 0) -> bool:
        """A float32 value the backend made from a 16-bit one: a convert without an op
        name of its own (or named for the matrix product or convolution it feeds), or a
        layout change of such a value."""
        ins = self.hlo.instructions.get(name)
        if ins is None or depth > 3:
            return False
        backend = ins.op_name == "" or ins.op_name.endswith(("dot_general", "conv_general_dilated"))
        if not backend:
            return False
        if self.sixteen_bit and ins.op_name:  # the product's own float32 result
            return True
        sources = [self.hlo.instructions.get(o) for o in ins.operands]
        if "convert" in name and any(
            s is not None and _ELEMENT.findall(s.shape)[:1] in ([t] for t in _SIXTEEN)
            for s in sources
        ):
            return True
        if ins.opcode in _PASS or ins.opcode == "fusion":
            return any(self.upcast(o, depth + 1) for o in ins.operands)
        return False


def _by_op_name(ins: _Instruction) -> str | None:
    """The part an op name tells (the scopes JAX's transformations leave in it)."""
    op = ins.op_name
    if not op:
        return None
    if "rematted_computation" in op:
        # A layer's own rule (nn/_jvp) recomputes inside its backward pass: not remat's.
        return "backward" if RULE_SCOPE in op else "recomputation"
    if "transpose(" in op:
        # A loop of the backward pass carries the gradients of its stack's parameters.
        return "gradients" if ins.opcode == "while" else "backward"
    if "jvp(" in op:
        return "activations"
    if ins.opcode == "while":
        return "gradients"  # the micro-batch loop: its carry is the accumulator
    if "/while" in op or op.startswith(("dynamic[", "batch[")) or op == "w":
        return None  # inside a loop, but neither differentiated nor recomputed; arguments
    # After the micro-batch loop: the mean gradient, the optimizer's update (zeros made to
    # start a loop are the loop's: see the users).
    return None if op.endswith("broadcast_in_dim") else "update"


def argument_parts(dynamic_parts: list[str]) -> Callable[[str], str]:
    """`read_peak`'s `argument_part` for a step called as `(batch, w, dynamic, ...)`:
    `dynamic_parts[k]` is the part of the k-th array of the state."""

    def part(op_name: str) -> str:
        match = re.match(r"dynamic\[(\d+)\]", op_name)
        if match:
            k = int(match.group(1))
            return dynamic_parts[k] if k < len(dynamic_parts) else "other"
        return "batch"

    return part


def compile_with_peak(
    lowered: Any,
    options: dict[str, Any],
    argument_part: Callable[[str], str],
    *,
    sixteen_bit: bool = False,
    target: str = "",
) -> tuple[Any, Peak | None]:
    """`lowered.compile(compiler_options=options)` with XLA's dump in a temporary
    directory, and the live set at its peak (None where it cannot be read).

    The compilation is kept (the last `_CACHE_SIZE`, keyed on the lowered module's text,
    `options` and `target`, the description of the machine compiled for): a second call
    for the same program reuses it, with no compile, and reads its dump again.
    """
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), repr(sorted(options.items(),
           key=lambda kv: kv[0])), target)  # fmt: skip
    if key in _CACHE:
        _CACHE.move_to_end(key)
    else:
        _CACHE[key] = _compile_dumped(lowered, options)
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    compiled, dumps = _CACHE[key]
    return compiled, None if dumps is None else _parse_peak(dumps, argument_part, sixteen_bit)


def _compile_dumped(lowered: Any, options: dict[str, Any]) -> tuple[Any, tuple | None]:
    global compile_count
    compile_count += 1
    directory = tempfile.mkdtemp(prefix="eqx_lowmem_xla_")
    try:
        compiled = lowered.compile(compiler_options={**options, **DUMP_OPTIONS,
                                                     "xla_dump_to": directory})  # fmt: skip
    except Exception as e:  # an XLA that refuses the dump options: compile as usual
        shutil.rmtree(directory, ignore_errors=True)
        if "compile option" not in str(e) and "xla_dump" not in str(e):
            raise
        return lowered.compile(compiler_options=options), None
    return compiled, _read_dumps(directory)
