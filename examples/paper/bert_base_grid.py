"""BERT-Base / SQuAD 2.0, grid search: 40 trials to 27,000 steps (Hippo Table 1). The metric
``val_acc`` stands for F1."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _paper import WORKERS, bert_space, bert_trainer  # noqa: E402

from stagetree import GridSearch  # noqa: E402

name = "bert-base-grid"
seed = 0
workers = WORKERS
trainer = bert_trainer()
tuner = GridSearch(bert_space(), 27000, metric="val_acc", mode="max")
