"""The job API and the guard: Job/Run/Update, one rank's entry, the rank's runtime, phases, guard, L1 wiring, stops."""
