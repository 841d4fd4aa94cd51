"""`python -m neuron_runtime.cli` == `neuron-cache`."""

from neuron_runtime.cli._main import main

raise SystemExit(main())
