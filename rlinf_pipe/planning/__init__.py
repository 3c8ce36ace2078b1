"""Planning without Ray: GPU-range placement, the run's decided shape (`RunPlan`), weight routes, the memory
estimate and the `plan` report. It imports no engine and no Ray (an import-linter contract)."""
