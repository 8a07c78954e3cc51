"""A folder of ColossalAI paths inside the core package `meshboost.pipeline.schedule` (each file here is
served as `meshboost.pipeline.schedule.<file>` by compat/paths.py); never a module of its own."""
