"""A small SHA study, simulated and exported by stagetree before tuner decisions were events (main at af8465c)."""
from stagetree import GridSearchSpace, SimulatedTrainer, SuccessiveHalving, hp

name = "old-sha"
trainer = SimulatedTrainer("old-toy", ("lr", "momentum", "batch_size"))
space = GridSearchSpace({"lr": [hp.Constant(0.3), hp.Constant(0.1), hp.MultiStep(0.1, (4,), 0.1), hp.Constant(0.01)],
                         "momentum": [hp.Constant(0.9), hp.Constant(0.5)], "batch_size": [hp.Constant(128)]})
tuner = SuccessiveHalving(space, "val_acc", min_steps=2, max_steps=8, reduction=2)
workers = 2
