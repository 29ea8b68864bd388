"""The one data path of a training step and of an evaluation: rows -> trajectories -> scores -> left-out reasons ->
datums -> advantages (:mod:`~trl_plugins.pipeline.batch`), with the judges that score while the rollout runs
(:mod:`~trl_plugins.pipeline.prescoring`). It stands below both of its users: the trainer's step
(:mod:`trl_plugins.trainers`) and :mod:`trl_plugins.evaluation`."""
