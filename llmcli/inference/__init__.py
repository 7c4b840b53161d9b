"""Steps 3-7 on llama.cpp: the only package that imports llama_cpp. Importing the package loads nothing."""
