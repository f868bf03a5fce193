"""The launch checks every queued config passes (services/controller/launch_checks.py: a study
import, below the API, runs them too), where the API's routes import them."""

from services.controller.launch_checks import check_launch as check_launch

__all__ = ["check_launch"]
