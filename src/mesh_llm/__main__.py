from mesh_llm.cli import main

main()
