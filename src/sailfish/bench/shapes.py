"""The benchmarks' shape lists and their command-line parsers (python -m sailfish.bench,
sailfish.bench.tune, .e2e, .overhead)."""
from __future__ import annotations

from typing import List, Tuple

LLAMA_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
                (8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]
M_LIST = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SHAPE_SETS = {"8b": LLAMA_SHAPES[:4], "70b": LLAMA_SHAPES[4:], "all": LLAMA_SHAPES}


# ----------------------------------------------------------------------------------
# argument parsing
# ----------------------------------------------------------------------------------
def parse_shapes(text: str) -> List[Tuple[int, int]]:
    """'8b', '70b', 'all', 'KxN' items, comma separated (mixable); order kept, duplicates dropped."""
    out: List[Tuple[int, int]] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if not item:
            continue
        if item in SHAPE_SETS:
            new = SHAPE_SETS[item]
        else:
            parts = item.split("x")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"bad shape {item!r}: use KxN (e.g. 4096x4096), 8b, 70b or all")
            k, n = int(parts[0]), int(parts[1])
            if k <= 0 or n <= 0:
                raise ValueError(f"bad shape {item!r}: K and N must be positive")
            new = [(k, n)]
        out += [s for s in new if s not in out]
    if not out:
        raise ValueError("no shapes given")
    return out


def parse_m(text: str) -> List[int]:
    """'all' or a comma list of positive ints; order kept, duplicates dropped."""
    if text.strip().lower() == "all":
        return list(M_LIST)
    return parse_ints(text, "M", " (or 'all')")


def parse_ints(text: str, what: str, hint: str = "") -> List[int]:
    """A comma list of positive ints; order kept, duplicates dropped."""
    out: List[int] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) <= 0:
            raise ValueError(f"bad {what} {item!r}: use positive integers{hint}")
        if int(item) not in out:
            out.append(int(item))
    if not out:
        raise ValueError(f"no {what} given")
    return out
