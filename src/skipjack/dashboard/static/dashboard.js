// skipjack dashboard: the only script of its own (the pages work without it). Ticking
// "select all" ticks every job on the page.
document.addEventListener("change", function (event) {
  var box = event.target;
  if (box && box.id === "select-all") {
    document.querySelectorAll("input.pick").forEach(function (pick) {
      pick.checked = box.checked;
    });
  }
});
