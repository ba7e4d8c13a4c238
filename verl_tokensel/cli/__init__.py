"""The ``verl-tokensel`` command: one subcommand per module, :mod:`.main` is the front end. Nothing imports it."""
