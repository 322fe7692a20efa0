"""`python -m streamsched ...` is the `streamsched` command."""

from streamsched.cli import main

raise SystemExit(main())
