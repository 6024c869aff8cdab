"""One training run: data module, Lightning module, metrics, MLflow tracking, CLI.

Entry point: ``python -m pipeline fit|validate|test ...`` (:mod:`pipeline.cli`). Many runs and
their reports are the lab's (``python -m experiments ...``)."""

import logging as _logging
import warnings as _warnings


class _Quiet(_logging.Filter):
    """Lines Lightning logs on every run that tell a user nothing: an advertisement for its cloud
    logger, and that it did not add the model summary the pipeline adds itself."""

    NOISE = ("litlogger", "Skipping setting a default `ModelSummary`")

    def filter(self, record: _logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.NOISE)


_logging.getLogger("pytorch_lightning.utilities.rank_zero").addFilter(_Quiet())
# Lightning 2.6's own use of a torch API that newer torch deprecates; nothing a user can act on
_warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
# Lightning wraps DDP on a side stream (its issue 21567), so the parameters' AccumulateGrad nodes are on
# another stream than any backward: torch warns once per process; what it costs is an event wait per gradient
_warnings.filterwarnings("ignore", message=r"The AccumulateGrad node's stream does not match")
