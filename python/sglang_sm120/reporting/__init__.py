"""What a user sends back from a real box, offline and without torch: the benchmark result documents' schema
(schema), markdown for routing tables and results (render), and the report that gathers the environment, the
doctor's output, the tune tables and the results into one markdown file with its JSON attached (document)."""
