"""How much a published row's error rests on its assumed micro-batch: the Megatron-LM rows without
pipeline parallelism (their micro-batch is not published; the rows assume 1) predicted again at each
micro-batch that divides a rank's share of the global batch, the rest of the row as it is.

    python scripts/validate_micro_batch.py [validation/published-runs.yaml]
"""

import copy
import sys

from echobench.predict.validate import load_rows, validate_row


def main() -> None:
    rows = load_rows(sys.argv[1] if len(sys.argv) > 1 else "validation/published-runs.yaml")
    for row in rows:
        run = row["run"]
        if row["source"]["repo"] != "NVIDIA/Megatron-LM" or run.get("pp", 1) != 1:
            continue
        share = run["micro_batch"] * run["grad_accum"]  # sequences per data-parallel rank and step
        cells = []
        for mb in (m for m in (1, 2, 4, 8) if share % m == 0):
            changed = copy.deepcopy(row)
            changed["run"].update(micro_batch=mb, grad_accum=share // mb)
            cells.append(f"{mb} x {share // mb}: {validate_row(changed, {}).error:+.1%}")
        print(f"{row['id']:<22} " + "   ".join(cells))


if __name__ == "__main__":
    main()
