"""The project's figures, drawn from its evidence files: `throughput` for the cross-step comparison, `profile`
for step 05's profiles, `latency` for step 08's open-loop benchmark. matplotlib is a test extra: each module
imports it only to draw."""
