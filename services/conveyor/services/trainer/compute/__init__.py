"""Compute: what runs on the trainer's device. ``session`` builds a joined job's fixed parts
(spec, plan, device, model, engine); ``engine`` is the torch side (forward/backward, evaluation,
loading a parameter version, the step's encoded gradient), called from the one compute thread;
``snapshots`` keeps each epoch's end-of-epoch parameters and builds the frozen model its eval
batches are evaluated on."""
