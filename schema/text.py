"""Words of the messages every folder prints: a count with its noun in the right number."""
from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None, spec: str = "") -> str:
    """`n` and `noun` in the number `n` needs: count(1, "stage") is "1 stage", count(2, "stage")
    "2 stages", count(0, "process", "processes") "0 processes"; `spec` formats the number
    (count(1200, "line", spec=",") is "1,200 lines")."""
    return f"{n:{spec}} {noun if n == 1 else plural or noun + 's'}"
