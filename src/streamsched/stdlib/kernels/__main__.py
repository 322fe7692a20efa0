"""`python -m streamsched.stdlib.kernels --doc`: regenerate docs/kernels.md's kernel table (`_doc`)."""

from streamsched.stdlib.kernels._doc import main

raise SystemExit(main())
