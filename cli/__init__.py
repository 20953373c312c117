"""The `tandem` command: its subcommands, the local stack (`tandem up`) and its supervisor."""
