"""The ``verl-tokensel`` subcommands of the CPU distribution (entry-point group ``verl_tokensel.commands``)."""
