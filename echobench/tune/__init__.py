"""`echobench tune`: the best configuration of a scale on a node count, found by the performance
model and proven by measurement (docs/guides/tune.md).

    space.py   the tune file (TuneFile), the search space of a scale on a node count, what the rules,
               the held global batch and the memory estimate prune, the predicted ranking, the picks
               (top K and each layout family's best)
    loop.py    measuring the picks as one sweep, residuals, recalibration on a shared bias, the next
               picks and when to stop; the device-hours charged
    output.py  TUNE/tune.json, report.md and the winners' run config and one-run matrix; the console table
    cards.py   a model card's layouts ranked, its picks as card runs the loop measures (what echobench
               cannot run as a card run ranked only, with why)

May import: sweep, predict, train, hardware, data, records, backends, model.
"""

