"""The documentation pages (Markdown), installed with the package as `mkresearch.docs` so that
code can read them where there is no repository, e.g. on Colab: `mkresearch.views.guide` shows
the map of the notebooks (notebooks.md) and the glossary (glossary.md) from them. No code."""
