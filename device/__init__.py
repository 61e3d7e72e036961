"""Repository tools for a lent GPU's lease (not installed with the wheel): staging what a check needs in
parts that fit the tool's 64 MiB a call (`pack`, `stage`, `aside`), the prepared device check (`check`)
and the prepared training lease (`train`). README.md says how to run a lease step by step."""
