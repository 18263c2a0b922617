"""Training shared by every strategy: models, the step and evaluation (`engine`), one
seeding rule, the training loop, and the contracts a strategy fulfils (`strategy`)."""
