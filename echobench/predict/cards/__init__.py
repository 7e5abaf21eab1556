"""Model cards: a plain decoder-only transformer beside Echo (a published run's model, or a card
file), predicted with the same pricing, collectives and pipeline as an Echo run, and run by
`echobench run --card` (model.decoder).

    card.py     a plain decoder as a model card: ModelCard, Layout (model_card, run_layout from a
                published row, every key checked), parameters per rank
    run.py      a run's card setting read (a card file or a published row): run_card -> CardWorkload;
                the layout a card run ran (measured_layout)
    work.py     a card step's work on a rank: card_work (GEMMs, attention, element-wise bytes
                counted on the framework's eager block or per fused op, float8 casts, host ops)
    memory.py   a card's memory per GPU under a layout (card_memory_gib): the training state each
                framework keeps (predict.memory.adam_state_bytes), the activations
    traffic.py  a card step's collectives as hardware.traffic.Traffic (card_traffic) and their placement (place_card)
    model.py    a card's predicted step: predict_card -> CardPrediction (work_seconds, place, exposed)

The names callers use are re-exported by echobench.predict.
"""
