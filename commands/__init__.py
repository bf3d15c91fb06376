"""The commands of ``moetrace``, one file each, with their options in their signatures
and their examples beside them; ``options`` holds what several share. cli.py registers
them; nothing else imports this folder. Each command parses its options into the records
the library takes and imports the library inside its body, so ``moetrace --help`` stays
light."""
