"""Scripts that `bench engine --peers` runs under a peer engine's own interpreter (a venv with
llama-cpp-python or vLLM, never this project's): each reads one job as JSON on stdin and prints
one JSON result line. They import nothing from matrixinfer, so that they run where it is not
installed."""
# (named run_*.py: a script's folder comes first on sys.path, so llama_cpp.py would import itself)
