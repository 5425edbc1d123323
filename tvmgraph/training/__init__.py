"""Training in graph mode: optimizer lowering (optimizers.py), the plan of what is updated
(plan.py), the autodiff + update pass (train_step.py) and the runtime glue (runtime.py)."""
