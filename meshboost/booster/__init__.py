"""Booster, the Plugin interface and the wrappers boosted objects come back in."""

from meshboost.booster.booster import Booster
from meshboost.booster.plugin_base import Plugin
from meshboost.booster.qlora import QuantConfig
from meshboost.booster.wrappers import ModelWrapper
from meshboost.optim import OptimizerWrapper

__all__ = ["Booster", "Plugin", "ModelWrapper", "OptimizerWrapper", "QuantConfig"]
