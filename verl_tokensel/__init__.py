"""verl-tokensel: restrict verl's policy-gradient update to the tokens that matter.

The selector core (:mod:`verl_tokensel.core`) is pure torch and never imports verl; the verl
glue lives in :mod:`verl_tokensel.verl_glue` and is loaded by verl's ``verl.plugins`` entry point.
"""

__version__ = "0.1.0"
TESTED_VERL_VERSION = "0.9.1"
SUPPORTED_VERL = ">=0.9.1,<0.10"  # the install_requires range of verl (setup.cfg; a test keeps them equal)
