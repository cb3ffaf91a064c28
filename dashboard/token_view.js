// The Token inspector's component (dashboard/token_view.py says why): token_spans.js's drawTokens, which
// token_view.py puts before this, in a block of its own that later runs of the page update.

export default function ({ data, parentElement }) {
  let block = parentElement.querySelector("div.pl-tokens");
  if (!block) {
    block = document.createElement("div");
    block.className = "pl-tokens";
    parentElement.appendChild(block);
  }
  drawTokens(block, data);
}
