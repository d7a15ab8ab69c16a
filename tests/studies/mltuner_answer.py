"""A softmax regression on the digits data (tests/studies/public_api.py's trainer) whose
MLtunerTuner answers with an evaluation before its main line's last step (its val_acc falls
after the step it picked), and the same trainer in a grid when ``$STAGETREE_TEST_ANSWER`` is
``grid``. tests/test_mltuner.py (the summary's ``best_step``)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from public_api import Linear  # noqa: E402

from stagetree import GridSearch, GridSearchSpace, MLtunerTuner  # noqa: E402
from stagetree.hp import Constant  # noqa: E402

name = "mltuner-answer"
seed = 5
trainer = Linear()
if os.environ.get("STAGETREE_TEST_ANSWER") == "grid":
    name = "grid-answer"
    tuner = GridSearch(GridSearchSpace({"lr": [Constant(0.1), Constant(0.5)], "batch_size": [Constant(16)]}),
                       steps=20, metric="val_acc", mode="max")
else:
    tuner = MLtunerTuner([{"lr": 0.1, "batch_size": 16}], "val_acc", "max", tunables={"lr": [0.01, 0.1, 0.5]},
                         max_steps=40, epoch_steps=5, trial_steps=5, points=2, patience=2,
                         progress_metric="loss")
