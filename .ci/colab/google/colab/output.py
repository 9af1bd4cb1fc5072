"""The one google.colab.output call the notebooks make (Colab's widget manager for ipywidgets 8)."""

enabled = False


def enable_custom_widget_manager() -> None:
    global enabled
    enabled = True
