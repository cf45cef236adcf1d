"""SLURM host lists: "node[001-003,007],gpu-a100-[09-12]" -> its host names.

A host list is groups separated by commas (or spaces) outside brackets;
a group is text with any number of bracketed ranges, "rack[1-2]-node[01-04]"
standing for every combination (rack1-node01, rack1-node02, ...). Ranges keep
their zero padding ("[001-003]" gives 001, 002, 003). Expansion is lazy, so
taking the first host of a huge list costs nothing.
"""

import itertools


def hosts(text):
    """Yield the host names of SLURM host list `text`, in order."""
    for group in _split_outside_brackets(text):
        parts = []
        for literal, ranges in _pieces(group, text):
            parts.append([literal])
            if ranges is not None:
                parts.append(list(_expand_ranges(ranges, text)))
        for combination in itertools.product(*parts):
            yield "".join(combination)


def first_host(text):
    """The first host of SLURM host list `text` (where rank 0 runs under
    SLURM's default block distribution)."""
    for host in hosts(text):
        return host
    raise ValueError(
        f"SLURM host list {text!r} names no host: expected e.g. "
        "'node[001-004]' or 'n1,n2'. Set MASTER_ADDR to the host of process 0."
    )


def _split_outside_brackets(text):
    groups, current, depth = [], [], 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth == 0 and char in ", \t\n":
            groups.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise _malformed(text, "its brackets do not pair")
    groups.append("".join(current))
    return [group for group in groups if group]


def _pieces(group, text):
    """(literal, bracket contents or None) pairs of one group."""
    pieces, rest = [], group
    while rest:
        literal, bracket, after = rest.partition("[")
        if not bracket:
            pieces.append((literal, None))
            break
        inside, closing, rest = after.partition("]")
        if not closing:
            raise _malformed(text, "a '[' is not closed")
        pieces.append((literal, inside))
    return pieces


def _expand_ranges(ranges, text):
    for item in ranges.split(","):
        item = item.strip()
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise _malformed(
                text, f"[{ranges}] holds {item!r}, not a number or range"
            )
        if not dash:
            yield low
            continue
        if int(high) < int(low):
            raise _malformed(text, f"range {item!r} runs backwards")
        for number in range(int(low), int(high) + 1):
            yield f"{number:0{len(low)}d}"


def _malformed(text, why):
    return ValueError(
        f"SLURM host list {text!r} is malformed: {why}. Expected e.g. "
        "'node[001-004,007]' or 'n1,n2'. Set MASTER_ADDR to the host of "
        "process 0 to skip reading it."
    )
