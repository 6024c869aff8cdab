"""Training pipeline: data module, Lightning module, metrics, MLflow tracking, CLI, main job.

Entry points: ``python -m pipeline fit ...`` (:mod:`pipeline.cli`), ``python -m pipeline.data
bench ...`` and ``python -m pipeline.experiment ...`` (the main job, ``make experiment``).
"""
