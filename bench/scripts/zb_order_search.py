"""Every order of F, B and W on the last of 2 stages, against the memory it holds.

    .venv/bin/python -m bench.scripts.zb_order_search

The first stage runs 1F1B's order (its W inside B, as ZB-H1's first stage does); for the last
stage every order of m forwards, input-gradient passes and weight passes that respects F_j < B_j
< W_j is simulated on parallel/zb_timeline.py's dependency graph at measured per-micro-batch
costs. Memory is counted in units of one micro-batch's activations A, a pending W set being
`ratio` units (the planner's weight_grad_bytes / layer_activation_bytes of that stage). For
each peak the fastest order is printed with its bubble as a share of 1F1B's.
"""
import sys

from parallel.zb_timeline import fixed, one_f_one_b_order, simulate

COSTS = {  # CPU seconds per micro-batch, last stage (docs/pipeline.md, zero-bubble schedule)
    "default model (6L-6L d=128)": {"F": 0.077, "B": 0.082, "W": 0.043},
    "base-6-6 (6L-6L d=512)": {"F": 0.70, "B": 0.68, "W": 0.57},
}
RATIO = 1.21  # W set / activations of the last stage (planner, base-6-6 and default alike: 1.20-1.21)


def orders(m: int) -> list[list[tuple[str, int]]]:
    found = []

    def extend(f: int, b: int, w: int, order: list) -> None:
        if w == m:
            found.append(list(order))
            return
        for kind, ok, nxt in (("F", f < m, (f + 1, b, w)), ("B", b < f, (f, b + 1, w)), ("W", w < b, (f, b, w + 1))):
            if ok:
                order.append((kind, (f, b, w)["FBW".index(kind)]))
                extend(*nxt, order)
                order.pop()

    extend(0, 0, 0, [])
    return found


def peak(order: list[tuple[str, int]], ratio: float) -> float:
    held = pending = top = 0
    for kind, _ in order:
        held += kind == "F"
        if kind == "B":
            held, pending = held - 1, pending + 1
        pending -= kind == "W"
        top = max(top, held + pending * ratio)
    return top


def main(m: int = 4) -> None:
    for name, cost in COSTS.items():
        work = 2 * m * (cost["F"] + cost["B"] + cost["W"])
        first = one_f_one_b_order(2, m, 0)
        span = max(ops[-1][1] for ops in simulate(2, m, cost, fixed([first, one_f_one_b_order(2, m, 1)])))
        base = 1 - work / (2 * span)
        best: dict[float, tuple[float, list]] = {}
        candidates = orders(m)
        for order in candidates:
            try:
                end = max(ops[-1][1] for ops in simulate(2, m, cost, fixed([first, order])))
            except RuntimeError:  # waits for a forward the first stage sends only after this B
                continue
            key = round(peak(order, RATIO), 2)
            if key not in best or end < best[key][0]:
                best[key] = (end, order)
        print(f"{name}, m = {m}: 1F1B bubble {base:.3f}; {len(candidates)} last-stage orders")
        for key in sorted(best):
            end, order = best[key]
            print(f"  peak {key:.2f} A: bubble {(1 - work / (2 * end)) / base:.2f} of 1F1B's  "
                  + " ".join(f"{k}{j}" for k, j in order))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
