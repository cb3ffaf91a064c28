// The report's token section (dashboard/report.py): one folded block per channel, each drawn with token_spans.js's
// drawTokens the first time it is open. marks: what every channel shares (texts, hover texts, clip marks, styles);
// colours: by channel, its colour per token and its palette.

function drawChannelBlocks(marks, colours) {
  document.querySelectorAll("details.pl-channel").forEach((block) => {
    const draw = () => {
      if (!block.open || block.dataset.drawn) return;
      block.dataset.drawn = "1";
      drawTokens(block.querySelector("div.pl-tokens"), { ...marks, ...colours[block.dataset.channel] });
    };
    block.addEventListener("toggle", draw);
    draw();
  });
}
